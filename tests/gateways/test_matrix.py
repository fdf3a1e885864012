"""The gateway matrix: a real Envoy configured exactly as each gateway configures ext_proc
(extproc/gateways.py; ours is `extproc envoy-config`), `extproc serve` behind it, echo
upstreams behind that, and five kinds of request through each. Every body arrives whole: the
upstream reports the SHA-256 of what it received, the client checks every byte it got back.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest

from extproc.bootstrap import BootstrapOptions
from extproc.gateways import AI_GATEWAY, AI_GATEWAY_BUFFERED, ISTIO, LLM_D, gateway_bootstrap, ours
from extproc.sim import echo
from extproc.stack import Stack, StackOptions, wait_until

pytestmark = pytest.mark.e2e

PROFILES = {"ours": None, **{g.name: g for g in (ISTIO, AI_GATEWAY, AI_GATEWAY_BUFFERED, LLM_D)}}


@dataclass
class Gate:
    name: str
    stack: Stack

    def picker_inflight(self) -> float:
        text = httpx.get(f"http://127.0.0.1:{self.stack.picker_admin_port}/metrics").text
        return sum(
            float(m.group(1))
            for m in re.finditer(r"^extproc_inflight_requests\{[^}]*\} (\S+)$", text, re.M)
        )


@pytest.fixture(scope="module", params=sorted(PROFILES))
def gate(request) -> Iterator[Gate]:
    gw = PROFILES[request.param]

    def bootstrap(opts: BootstrapOptions) -> dict[str, Any]:
        return ours(opts) if gw is None else gateway_bootstrap(gw, opts)

    lb = "override-host" if gw is not None and gw.routing == "override-host" else "original-dst"
    with Stack(StackOptions(upstreams=2, lb=lb, bootstrap=bootstrap)) as stack:
        yield Gate(request.param, stack)


def chat(prompt_bytes: int = 100) -> bytes:
    prompt = ("hello gateway " * (prompt_bytes // 14 + 1))[:prompt_bytes]
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}]})


@pytest.fixture(autouse=True)
def no_protocol_errors(gate: Gate) -> Iterator[None]:
    """Envoy counted no out-of-order reply from the picker and no failed stream."""
    yield
    stats = gate.stack.envoy_stats("ext_proc")
    bad = {
        k: v
        for k, v in stats.items()
        if k.endswith(("spurious_msgs_received", "streams_failed")) and v
    }
    assert bad == {}, bad


def check_echo(gate: Gate, payload: dict, sent: bytes) -> None:
    assert payload["body_sha256"] == hashlib.sha256(sent).hexdigest(), "body changed in transit"
    assert payload["body_bytes"] == len(sent)
    assert payload["endpoint"] in gate.stack.upstream_addresses
    assert payload["destination_header"] == payload["endpoint"]  # the picker's choice served


def streamed_headers(chunks: int, size: int, gap_ms: int = 0) -> dict[str, str]:
    return {
        echo.CHUNKS_HEADER: str(chunks),
        echo.CHUNK_BYTES_HEADER: str(size),
        echo.CHUNK_GAP_HEADER: str(gap_ms),
    }


def expected_stream(chunks: int, size: int) -> bytes:
    return b"".join(echo.stream_chunk(i, size) for i in range(chunks))


def split_stream(data: bytes) -> tuple[dict, bytes]:
    line, _, rest = data.partition(b"\n")
    return orjson.loads(line), rest


def test_non_streaming(gate: Gate):
    body = chat()
    with httpx.Client(base_url=gate.stack.url, timeout=30) as c:
        for _ in range(3):
            r = c.post("/v1/chat/completions", content=body)
            assert r.status_code == 200, (r.status_code, r.text, gate.stack.logs("envoy")[-2000:])
            check_echo(gate, r.json(), body)


def test_streaming(gate: Gate):
    body = chat()
    chunks, size = 40, 300
    with (
        httpx.Client(base_url=gate.stack.url, timeout=30) as c,
        c.stream(
            "POST",
            "/v1/chat/completions",
            content=body,
            headers=streamed_headers(chunks, size, gap_ms=5),
        ) as r,
    ):
        assert r.status_code == 200
        got = b"".join(r.iter_raw())
    payload, rest = split_stream(got)
    check_echo(gate, payload, body)
    assert rest == expected_stream(chunks, size)


def test_four_megabyte_bodies(gate: Gate):
    """4 MB up and 4 MB down."""
    body = chat(4 * 1024 * 1024)
    chunks, size = 64, 65_536
    with httpx.Client(base_url=gate.stack.url, timeout=60) as c:
        r = c.post("/v1/chat/completions", content=body, headers=streamed_headers(chunks, size))
    if gate.name == AI_GATEWAY_BUFFERED.name:
        # BUFFERED is bounded by Envoy's buffer (1 MiB per connection by default): Envoy
        # itself answers 413 before the picker sees anything. Not something a picker can fix.
        assert r.status_code == 413, r.status_code
        return
    assert r.status_code == 200, (r.status_code, r.text[:500])
    payload, rest = split_stream(r.content)
    check_echo(gate, payload, body)
    assert rest == expected_stream(chunks, size)


def test_client_gone_mid_response_leaves_nothing_in_flight(gate: Gate):
    body = chat()
    with (
        httpx.Client(base_url=gate.stack.url, timeout=30) as c,
        c.stream(
            "POST",
            "/v1/chat/completions",
            content=body,
            headers=streamed_headers(400, 100, gap_ms=10),
        ) as r,
    ):
        assert r.status_code == 200
        it = r.iter_raw()
        first = next(it)
        assert first
        if gate.name != "ours":
            # FULL_DUPLEX response bodies keep the ext_proc stream, and so the count, open
            # until the answer ends. (Ours asks for no response body: its stream ends at the
            # response headers, and so does the count.)
            assert gate.picker_inflight() == 1
    # The client closed its connection with most of the answer unsent.
    wait_until(lambda: gate.picker_inflight() == 0, timeout_s=30, what="in-flight released")
    with httpx.Client(base_url=gate.stack.url, timeout=30) as c:
        r = c.post("/v1/chat/completions", content=body)
        assert r.status_code == 200
        check_echo(gate, r.json(), body)


def test_picker_paused_one_second_while_response_headers_pending(gate: Gate):
    """SIGSTOP the picker once the request reached the upstream, whose headers come 300 ms
    later: Envoy hands them to a frozen picker and must wait, not fail the served request."""
    body = chat()
    result: dict[str, Any] = {}
    stack = gate.stack

    def send() -> None:
        with httpx.Client(base_url=stack.url, timeout=30) as c:
            r = c.post(
                "/v1/chat/completions",
                content=body,
                headers={echo.HEADERS_DELAY_HEADER: "300"},
            )
            result["status"], result["content"] = r.status_code, r.content

    active = "cluster.model_servers.upstream_rq_active"
    t = threading.Thread(target=send)
    t.start()
    try:
        wait_until(
            lambda: not t.is_alive() or stack.envoy_stats(active).get(active, 0) >= 1,
            timeout_s=60,
            what="request at the upstream",
        )
        assert t.is_alive(), f"answered before reaching the upstream: {result}"
        pid = stack._procs["extproc"].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            time.sleep(1.0)
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        t.join(60)
    assert result.get("status") == 200, (result, stack.logs("envoy")[-2000:])
    check_echo(gate, orjson.loads(result["content"]), body)
