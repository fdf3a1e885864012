"""Endpoints from a watched file: formats, reloads, and a bad edit keeping the last good set."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from extproc.core import Endpoint
from extproc.endpoints.filewatch import EndpointFileWatch, load_endpoint_file, parse_endpoint_file
from extproc.errors import ConfigError


def test_strings_and_mappings_in_yaml_or_json() -> None:
    eps = parse_endpoint_file(
        "- 10.0.0.1:8000\n"
        "- {address: '[fd00::2]:8000', name: gpu-2, labels: {llm-d.ai/role: prefill}}\n"
    )
    assert [(e.address, e.name, e.role) for e in eps] == [
        ("10.0.0.1:8000", "", ""),
        ("[fd00::2]:8000", "gpu-2", "prefill"),
    ]
    assert parse_endpoint_file(json.dumps(["10.0.0.1:8000", {"address": "10.0.0.2:80"}])) == (
        Endpoint("10.0.0.1:8000"),
        Endpoint("10.0.0.2:80"),
    )
    assert parse_endpoint_file("") == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{a: 1}", "expected a list"),
        ("- host.example:8000", "[0]: endpoint"),
        ("- 10.0.0.1:8000\n- 10.0.0.1:8000", "[1]: duplicate address"),
        ("- {address: 10.0.0.1:8000, weight: 2}", "[0]:"),
        ("- [", "endpoints file"),
    ],
)
def test_bad_files_name_the_entry(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        parse_endpoint_file(text)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="missing"):
        load_endpoint_file(tmp_path / "missing.yaml")


def _write(path: Path, text: str) -> None:
    # A new file renamed over the old one, like editors and ConfigMap updates do.
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_reloads_on_change_and_keeps_the_last_good_set(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.yaml"
    _write(path, "- 10.0.0.1:8000\n")
    sets: list[tuple[Endpoint, ...]] = []
    watch = EndpointFileWatch(path, sets.append)
    watch.check()
    assert [e.address for e in sets[-1]] == ["10.0.0.1:8000"]
    watch.check()
    assert len(sets) == 1  # unchanged file: not re-read, not re-delivered

    _write(path, "- 10.0.0.1:8000\n- 10.0.0.2:8000\n")
    watch.check()
    assert [e.address for e in sets[-1]] == ["10.0.0.1:8000", "10.0.0.2:8000"]

    _write(path, "- not-an-address\n")
    watch.check()
    path.unlink()
    watch.check()
    watch.check()
    assert len(sets) == 2 and watch.stats.failures == 2

    _write(path, "- 10.0.0.1:8000\n- 10.0.0.2:8000\n")  # same set again: no callback
    watch.check()
    assert len(sets) == 2
    _write(path, "- {address: 10.0.0.1:8000, labels: {llm-d.ai/role: decode}}\n")
    watch.check()
    assert [e.role for e in sets[-1]] == ["decode"]


async def test_run_polls_until_cancelled(tmp_path: Path) -> None:
    path = tmp_path / "endpoints.json"
    _write(path, '["10.0.0.1:8000"]')
    sets: list[tuple[Endpoint, ...]] = []
    passes = 0

    async def sleep(_: float) -> None:
        nonlocal passes
        passes += 1
        if passes == 2:
            _write(path, '["10.0.0.3:8000"]')
        await asyncio.sleep(0)

    watch = EndpointFileWatch(path, sets.append, sleep=sleep)
    task = asyncio.create_task(watch.run())
    async with asyncio.timeout(5):
        while len(sets) < 2:
            await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [e.address for e in sets[-1]] == ["10.0.0.3:8000"]
    assert watch.synced.is_set()
