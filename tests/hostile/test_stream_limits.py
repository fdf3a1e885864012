"""Issue 18 at the ext_proc port itself (a peer that talks gRPC to the picker directly): one
request per stream, bytes that are not a ProcessingRequest, the body budget and deadline,
explain tokens, and the pieces they are built from."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter

import grpc
import msgspec
import pytest

from extproc import protocol
from extproc.config import Settings
from extproc.server.guard import PeerAllowList, Throttle, peer_ip
from extproc.server.limits import BodyBudget
from extproc.testing import (
    ThreadedPicker,
    body_chunks,
    destination,
    picker_in_thread,
    post,
    request_body,
    request_headers,
)
from extproc.testing import response_headers as response_headers_msg
from tests.hostile.conftest import hostile_settings
from tests.reliability.conftest import figure

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hello there"}]}'


def with_server(settings: Settings, **changes) -> Settings:
    return msgspec.structs.replace(
        settings, server=msgspec.structs.replace(settings.server, **changes)
    )


def raw_call(p: ThreadedPicker, frames: list[bytes]) -> tuple[list[bytes], grpc.StatusCode]:
    """Send arbitrary bytes as ext_proc messages; (responses, final status)."""
    with grpc.insecure_channel(p.target) as ch:
        call = ch.stream_stream(
            protocol.EXT_PROC_METHOD, request_serializer=bytes, response_deserializer=bytes
        )
        it = call(iter(frames), timeout=10)
        out: list[bytes] = []
        with contextlib.suppress(grpc.RpcError):
            out.extend(it)
        return out, it.code()


def test_one_stream_carries_one_request(picker: ThreadedPicker):
    """10,000 header messages on one stream used to make 10,000 decisions, each written to
    the index and counted in flight. Now the first routes, the second ends the stream."""
    before = picker.call(lambda: picker.app.router.stats.decisions)
    first = request_headers(post("/v1/chat/completions"))
    msgs = [first, *body_chunks(CHAT)]
    msgs += [request_headers(post("/v1/chat/completions"), end_of_stream=True)] * 10_000
    out = picker.exchange(msgs, timeout_s=60)
    after = picker.call(lambda: picker.app.router.stats.decisions)
    kinds = [r.WhichOneof("response") for r in out]
    figure("one_stream_many_requests", header_messages=10_001, decisions=after - before)
    assert after - before == 1
    assert destination(out[0]) is not None
    assert kinds[-1] == "immediate_response" and out[-1].immediate_response.status.code == 400
    assert picker.call(lambda: picker.app.router.inflight.requests(destination(out[0]))) == 0


def test_malformed_messages_log_one_line_not_a_traceback(
    picker: ThreadedPicker, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.DEBUG)
    codes = {raw_call(picker, [b"\xff\xff\xff\xff garbage"])[1] for _ in range(50)}
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    figure("malformed_protobuf_log", streams=50, log_lines=len(lines))
    assert codes == {grpc.StatusCode.INVALID_ARGUMENT}
    assert len(lines) == 1, [r.getMessage() for r in lines]
    assert lines[0].exc_info is None and lines[0].levelno == logging.WARNING
    # The picker still routes.
    assert destination(picker.exchange([request_headers(post("/v1/x")), *body_chunks(CHAT)])[0])


def test_budget_refuses_past_the_total_and_deadline_cuts_a_stall():
    settings = with_server(hostile_settings(), body_budget_bytes=100_000, body_timeout_s=1.0)
    with picker_in_thread(settings) as p:
        # A stream that sent 90 KB and stalls holds 90 KB of the 100 KB budget...
        with grpc.insecure_channel(p.target) as ch:
            call = ch.stream_stream(
                protocol.EXT_PROC_METHOD,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=lambda b: b,
            )

            def stalled():
                yield request_headers(post("/v1/chat/completions"))
                yield request_body(b"x" * 90_000, end_of_stream=False)
                time.sleep(5)

            started = time.monotonic()
            it = call(stalled(), timeout=10)
            # ...so a second stream's 20 KB does not fit: 503 at once.
            time.sleep(0.3)
            second = p.exchange(
                [request_headers(post("/v1/chat/completions")), *body_chunks(b"y" * 20_000)]
            )
            assert second[-1].immediate_response.status.code == 503
            first = list(it)
            cut_after = time.monotonic() - started
        from extproc.server.wire import ProcessingResponse

        (resp,) = [ProcessingResponse.FromString(b) for b in first]
        assert resp.immediate_response.status.code == 408
        assert 0.9 < cut_after < 4.0
        assert p.call(lambda: p.app.router.stats.decisions) == 0
        # Everything given back: a body that fits routes again.
        ok = p.exchange([request_headers(post("/v1/chat/completions")), *body_chunks(CHAT)])
        assert destination(ok[0]) is not None


def test_explanations_only_for_issued_tokens():
    token = "issued-token-0123456789"
    with picker_in_thread(with_server(hostile_settings(), explain_tokens=[token])) as p:

        def decision_header(asked: str) -> bool:
            resps = p.exchange(
                [
                    request_headers(post("/v1/chat/completions", {protocol.EXPLAIN_HEADER: asked})),
                    *body_chunks(CHAT),
                    response_headers_msg(200),
                ]
            )
            back = resps[-1].response_headers.response.header_mutation.set_headers
            return any(o.header.key == protocol.DECISION_HEADER for o in back)

        assert decision_header(token)
        assert not any(decision_header(a) for a in ("1", "true", token[:-1], token + "x", ""))


def test_default_settings_explain_to_nobody():
    with picker_in_thread(hostile_settings()) as p:
        resps = p.exchange(
            [
                request_headers(post("/v1/chat/completions", {protocol.EXPLAIN_HEADER: "1"})),
                *body_chunks(CHAT),
                response_headers_msg(200),
            ]
        )
    back = resps[-1].response_headers.response.header_mutation.set_headers
    assert not any(o.header.key == protocol.DECISION_HEADER for o in back)


def test_budget_accounting():
    b = BodyBudget(limit=10)
    assert b.take(6) and not b.take(5) and b.take(4)
    b.give(10)
    assert (b.used, b.peak, b.refused) == (0, 10, 1)


@pytest.mark.parametrize(
    ("peer", "allowed"),
    [
        ("ipv4:10.1.2.3:5000", True),
        ("ipv4:10.2.0.1:5000", False),
        ("ipv6:[::1]:5000", True),
        ("ipv6:[::ffff:10.1.0.9]:5000", True),
        ("unix:/tmp/sock", False),
        ("garbage", False),
    ],
)
def test_allow_list(peer: str, allowed: bool):
    assert PeerAllowList.parse(["10.1.0.0/16", "::1"]).allows(peer) is allowed
    assert PeerAllowList().allows(peer), "an empty list allows everyone"


def test_peer_ip_and_throttle():
    assert str(peer_ip("ipv4:127.0.0.3:41000")) == "127.0.0.3"
    t = Throttle(every_s=60)
    assert t.allow("k") == 0
    assert t.allow("k") is None and t.allow("k") is None
    t._last["k"] -= 61
    assert t.allow("k") == 2


def test_bad_allow_list_and_short_tokens_are_config_errors():
    from extproc.config import decode_settings
    from extproc.errors import ConfigError

    with pytest.raises(ConfigError):
        decode_settings({"server": {"allowed_clients": ["not-an-ip"]}})
    with pytest.raises(ConfigError):
        decode_settings({"server": {"explain_tokens": ["short"]}})


async def test_admin_explain_is_bounded_and_does_not_stall_routing():
    """Issue 18: a 36 MB `POST /debug/explain` stalled routing for 1.4 s. Now bodies past
    `admin_explain_max_bytes` (4 MiB) get 413, parsing runs in a thread, and a second
    concurrent explain gets 429 at once. Measured: decision latency while a 4 MB explain runs."""
    import asyncio

    import httpx
    import orjson

    from extproc.testing import ExtProcClient

    big = orjson.dumps(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": f"turn {i} " + "lorem ipsum dolor " * 40}
                for i in range(5_000)
            ],
        }
    )
    assert 3_500_000 < len(big) < 4 * 1024 * 1024
    settings = with_server(hostile_settings(), admin_port=0, max_body_bytes=64 << 20)
    from extproc.endpoints import parse_endpoints
    from extproc.server.app import App

    async with (
        App(settings, parse_endpoints(",".join(settings.endpoints))) as app,
        ExtProcClient(f"127.0.0.1:{app.port}") as client,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.admin_port}", timeout=60) as http,
    ):
        latencies: list[float] = []
        stop = asyncio.Event()

        async def route_loop() -> None:
            while not stop.is_set():
                t = time.perf_counter()
                await client.exchange(
                    [request_headers(post("/v1/chat/completions")), *body_chunks(CHAT)]
                )
                latencies.append(time.perf_counter() - t)

        baseline_task = asyncio.create_task(route_loop())
        await asyncio.sleep(0.5)
        base = sorted(latencies)
        latencies.clear()

        async def slow_upload():  # ~1 s of upload: the big explain holds its slot meanwhile
            step = len(big) // 8 + 1
            for i in range(0, len(big), step):
                yield big[i : i + step]
                await asyncio.sleep(0.12)

        first = asyncio.create_task(http.post("/debug/explain", content=slow_upload()))
        others: list[int] = []
        await asyncio.sleep(0.4)  # its headers are in: it holds the explain slot
        while not first.done():  # small explains meanwhile: 429 at once once it holds the slot
            others.append((await http.post("/debug/explain", content=CHAT)).status_code)
            await asyncio.sleep(0.02)
        explained = await first
        stop.set()
        await baseline_task
        too_big = await http.post("/debug/explain", content=b"x" * (5 << 20))
    figure(
        "admin_explain_4mb",
        explain_status=explained.status_code,
        concurrent_others=dict(Counter(others)),
        five_mb=too_big.status_code,
        decision_max_ms_before=round(base[-1] * 1000, 1),
        decision_max_ms_during=round(max(latencies) * 1000, 1),
        decisions_during=len(latencies),
    )
    assert explained.status_code == 200 and explained.json()["request_blocks"] > 0
    assert 429 in others and set(others) <= {200, 429}
    assert too_big.status_code == 413
    assert latencies, "routing stopped while the explain ran"
