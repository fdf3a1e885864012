"""The test suite's own safety net: nothing in it reaches beyond this machine."""

from __future__ import annotations

import socket

import pytest


@pytest.mark.parametrize("host", ["10.0.0.1", "192.168.1.1", "8.8.8.8"])
def test_tests_cannot_open_connections_off_this_machine(host: str):
    with socket.socket() as s, pytest.raises(OSError, match="this machine only"):
        s.connect((host, 80))
