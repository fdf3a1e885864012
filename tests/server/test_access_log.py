"""The access-log door ends its streams when the picker drains (server/lifecycle.py)."""

from __future__ import annotations

import asyncio
import logging

from extproc._proto.extproc.wire.v1 import access_log_pb2 as pb
from extproc.endpoints.inflight import InFlight
from extproc.endpoints.request_end import RequestEnds, RequestEndSettings
from extproc.server.access_log import AccessLogHandler


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
