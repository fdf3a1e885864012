"""The access-log door ends its streams when the picker drains (server/lifecycle.py)."""

from __future__ import annotations

import asyncio

from extproc._proto.extproc.wire.v1 import access_log_pb2 as pb
from extproc.endpoints.inflight import InFlight
from extproc.endpoints.request_end import RequestEnds, RequestEndSettings
from extproc.server.access_log import AccessLogHandler


class Envoy:
    """A client stream that sends what it is given and never half-closes, like Envoy's."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[pb.StreamAccessLogsMessage] = asyncio.Queue()

    def __aiter__(self) -> Envoy:
        return self

    async def __anext__(self) -> pb.StreamAccessLogsMessage:
        return await self.queue.get()


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
