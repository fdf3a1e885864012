"""The access-log door: it ends its streams when the picker drains (server/lifecycle.py),
and reads Envoy's response flags to tell a response cut short from a completed one."""

from __future__ import annotations

import asyncio
import logging

from extproc._proto.extproc.wire.v1 import access_log_pb2 as pb
from extproc.endpoints.inflight import InFlight
from extproc.endpoints.request_end import Ended, RequestEnds, RequestEndSettings
from extproc.server.access_log import AccessLogHandler, entries


class Envoy:
    """A client stream that sends what it is given and never half-closes, like Envoy's."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[pb.StreamAccessLogsMessage | None] = asyncio.Queue()

    def __aiter__(self) -> Envoy:
        return self

    async def __anext__(self) -> pb.StreamAccessLogsMessage:
        msg = await self.queue.get()
        assert msg is not None
        return msg


def entry(request_id: str) -> pb.StreamAccessLogsMessage:
    msg = pb.StreamAccessLogsMessage()
    msg.http_logs.log_entry.add().request.request_id = request_id
    return msg


async def test_end_answers_open_streams_and_later_ones():
    ends = RequestEnds(InFlight().release, RequestEndSettings())
    handler = AccessLogHandler(ends)
    envoy = Envoy()
    stream = asyncio.create_task(handler.stream(envoy, None))  # type: ignore[arg-type]
    envoy.queue.put_nowait(entry("r1"))
    await asyncio.sleep(0.05)
    assert handler.streams == 1 and not stream.done()
    assert ends.stats.entries == 1  # read while open

    handler.end()
    assert isinstance(await asyncio.wait_for(stream, 1), pb.StreamAccessLogsResponse)
    assert handler.streams == 0
    # A proxy reconnecting to a draining picker is answered at once too.
    late = await asyncio.wait_for(handler.stream(Envoy(), None), 1)  # type: ignore[arg-type]
    assert isinstance(late, pb.StreamAccessLogsResponse) and handler.streams == 0


class Gone(Envoy):
    """A stream the proxy closes after what it was given (a connection that went)."""

    async def __anext__(self) -> pb.StreamAccessLogsMessage:
        msg = await self.queue.get()
        if msg is None:
            raise StopAsyncIteration
        return msg


async def test_losing_the_last_stream_is_said_and_counted_and_its_return_too(caplog):
    caplog.set_level(logging.INFO, logger="extproc.access_log")
    now = [100.0]
    ends = RequestEnds(InFlight().release, RequestEndSettings())
    handler = AccessLogHandler(ends, clock=lambda: now[0])
    first, second = Gone(), Gone()
    streams = [asyncio.create_task(handler.stream(e, None)) for e in (first, second)]  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    first.queue.put_nowait(None)  # one of two goes: counted, not yet a loss of the door
    await asyncio.wait_for(streams[0], 1)
    assert handler.lost == 1 and handler.streams == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    second.queue.put_nowait(None)  # the last one: said
    await asyncio.wait_for(streams[1], 1)
    assert handler.lost == 2 and handler.streams == 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "access-log stream lost, none open" in warned[0]
    now[0] += 7.5
    again = Envoy()
    reopened = asyncio.create_task(handler.stream(again, None))  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    assert "access-log stream open again after 7.5 s without one" in caplog.text
    handler.end()  # the picker's drain: no loss
    await asyncio.wait_for(reopened, 1)
    assert handler.lost == 2
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def _varint(n: int) -> bytes:
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([low])
        out += bytes([low | 0x80])


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def envoy_entry(request_id: str, status: int, flags: tuple[int, ...]) -> bytes:
    """One HTTP entry encoded by hand with the field numbers of Envoy's own protos
    (envoy.data.accesslog.v3: HTTPAccessLogEntry.common_properties 1, request 3, response 4;
    AccessLogCommon.response_flags 16, whose flags are bools by number; request_id 9;
    response_code 1, a UInt32Value), not with our subset's generated code."""
    bools = b"".join(_varint(n << 3) + b"\x01" for n in flags)
    common = _field(16, bools)
    request = _field(9, request_id.encode())
    response = _field(1, _varint(1 << 3) + _varint(status))
    entry = _field(1, common) + _field(3, request) + _field(4, response)
    return _field(2, _field(1, entry))  # http_logs.log_entry


def test_response_flags_tell_a_hang_up_from_a_completion():
    # Envoy's numbers: upstream_request_timeout 3, upstream_remote_reset 5,
    # downstream_connection_termination 15, stream_idle_timeout 17, local_reset 4.
    cases = {
        "done": (200, (), ""),
        "hung-up": (200, (15,), "client"),
        "reset": (200, (5,), "upstream"),
        "idle": (200, (17,), "timeout"),
        "timed-out": (504, (3,), "timeout"),
        "local": (200, (4,), "proxy"),
        "both": (200, (5, 15), "client"),  # the client's hang-up said first
    }
    for rid, (status, flags, cut) in cases.items():
        msg = pb.StreamAccessLogsMessage.FromString(envoy_entry(rid, status, flags))
        (ended,) = entries(msg)
        assert (ended.request_id, ended.status, ended.cut) == (rid, status, cut)
        assert ended.completed == (rid == "done")


def test_ends_logged_complete_but_cut_are_counted_by_reason():
    ends = RequestEnds(InFlight().release, RequestEndSettings())
    ends.ended(Ended("a", status=200, cut="client"))
    ends.ended(Ended("b", status=200))
    ends.ended(Ended("c", cut="client"))  # the client left before the response headers
    ends.ended(Ended("d", status=504, cut="timeout"))  # its status already says it failed
    ends.ended(Ended("e", status=200, cut="upstream"))
    ends.ended(Ended("f", status=200, cut="client"), forwarded=True)  # counted where received
    assert ends.stats.cut == {"client": 2, "upstream": 1}
    assert ends.stats.entries == 5


def test_the_cut_counter_exports_every_reason():
    from extproc.endpoints.request_end import CUT_REASONS
    from extproc.server.families import REQUEST_ENDS

    assert REQUEST_ENDS.exported["cut"].keys == CUT_REASONS
