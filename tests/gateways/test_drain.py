"""A rolling restart of the picker under a real gateway's settings: Istio's ext_proc filter
(response body FULL_DUPLEX_STREAMED, trailers sent: the stream lasts to the response's end,
and Envoy resets the response if it is still open when the picker exits). SIGTERM mid-
response: the drain waits past `grace_s` (1 s here) for the response under way, which
arrives whole and in order (server/drain.py; on main it was cut at the grace)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from extproc.bootstrap import BootstrapOptions
from extproc.gateways import ISTIO, gateway_bootstrap
from extproc.stack import Stack, StackOptions
from tests.gateways.test_matrix import chat, expected_stream, split_stream, streamed_headers

pytestmark = pytest.mark.e2e


def istio(opts: BootstrapOptions) -> dict[str, Any]:
    return gateway_bootstrap(ISTIO, opts)


def test_sigterm_lets_a_streamed_response_finish_intact(tmp_path: Path):
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(yaml.safe_dump({"server": {"grace_s": 1.0, "response_grace_s": 30.0}}))
    opts = StackOptions(
        upstreams=1, lb="override-host", bootstrap=istio, extproc_args=("--config", str(cfg))
    )
    chunks, size = 30, 200  # one every 100 ms: ~3 s, the last ~2 s after the grace
    with Stack(opts) as s:
        exit_code: list[int] = []
        with (
            httpx.Client(base_url=s.url, timeout=30) as c,
            c.stream(
                "POST",
                "/v1/chat/completions",
                content=chat(),
                headers=streamed_headers(chunks, size, gap_ms=100),
            ) as r,
        ):
            assert r.status_code == 200
            it = r.iter_raw()
            got = next(it)
            stop = threading.Thread(target=lambda: exit_code.append(s.stop_extproc(signal.SIGTERM)))
            stop.start()
            got += b"".join(it)
        stop.join(30)
        log = s.logs("extproc")
    assert exit_code == [0]
    _, rest = split_stream(got)
    assert rest == expected_stream(chunks, size), "the response was cut or changed"
    assert "waiting up to 30 s for 1 open ext_proc streams" in log
    assert "were cut" not in log
