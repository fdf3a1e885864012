"""The gRPC access-log door: Envoy's `envoy.service.accesslog.v3.AccessLogService`, whose
entries tell the picker that a request has ended (see `endpoints/request_end.py`).

Envoy keeps one client stream open per worker and sends batches of HTTP entries on it; we
read the request id, the time to the first upstream byte, the upstream address, the status,
the response body size and the response flags that say the response stopped short (a client
that hung up mid-stream is logged with the 200 already sent: `Ended.completed`) of each, and
answer (the protocol's response is empty) only when the stream ends or the picker drains.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable

import grpc

from extproc._proto.extproc.wire.v1 import access_log_pb2 as pb
from extproc.endpoints.request_end import Ended, RequestEnds

log = logging.getLogger("extproc.access_log")

SERVICE = "envoy.service.accesslog.v3.AccessLogService"


def entries(msg: pb.StreamAccessLogsMessage) -> list[Ended]:
    """The ended requests one access-log message reports."""
    out = []
    for e in msg.http_logs.log_entry:
        common = e.common_properties
        ttfb = None
        if common.HasField("time_to_first_upstream_rx_byte"):
            d = common.time_to_first_upstream_rx_byte
            ttfb = d.seconds + d.nanos / 1e9
        upstream = ""
        if common.HasField("upstream_remote_address"):
            sa = common.upstream_remote_address.socket_address
            upstream = f"{sa.address}:{sa.port_value}"
        status = size = None
        if e.response.HasField("response_code"):
            status = e.response.response_code.value
            size = e.response.response_body_bytes
        cut = cut_reason(common.response_flags)
        out.append(Ended(e.request.request_id, ttfb, upstream, status, size, cut))
    return out


# Envoy's response flags that say a response stopped short, by the reason they tell
# (`request_end.CUT_REASONS`), the client's hang-up checked first. Envoy logs the status it
# had already sent: a stream cut after its headers is logged with a 200.
_CUT_FLAGS = (
    ("client", ("downstream_connection_termination",)),
    (
        "upstream",
        ("upstream_remote_reset", "upstream_connection_termination", "upstream_protocol_error"),
    ),
    (
        "timeout",
        (
            "upstream_request_timeout",
            "stream_idle_timeout",
            "upstream_max_stream_duration_reached",
            "duration_timeout",
        ),
    ),
    ("proxy", ("local_reset", "overload_manager")),
)


def cut_reason(flags: pb.ResponseFlags) -> str:
    """Why the response stopped short by `flags`, "" when none of them says it did."""
    if flags.ByteSize() == 0:  # no flag set: the common case, one call
        return ""
    for reason, names in _CUT_FLAGS:
        if any(getattr(flags, n) for n in names):
            return reason
    return ""


class AccessLogHandler:
    """Serves `StreamAccessLogs`; `streams` counts the ones open now, `lost` the ones the
    proxy closed (not `end()`).

    Envoy keeps one stream open per connection for as long as the connection lives, so a
    draining server would wait its whole grace for it: `end()` has every open stream answer
    and close (a draining picker calls it once its ext_proc streams are done).

    Losing the last stream is a degraded state, said once when it happens and once when a
    stream opens again (with how long there was none): until then no request's end is
    reported, so the in-flight counts held for their entries (`state.request_end`) stay up
    until `max_hold_s` and servers look busier than they are. Before, only the
    `extproc_access_log_streams` gauge going to 0 showed it."""

    def __init__(self, ends: RequestEnds, clock: Callable[[], float] = time.monotonic) -> None:
        self._ends = ends
        self._clock = clock
        self.streams = 0
        self.lost = 0
        self._none_since: float | None = None  # when the last stream was lost
        self._ending = asyncio.Event()

    async def stream(
        self, requests: AsyncIterator[pb.StreamAccessLogsMessage], context: grpc.aio.ServicerContext
    ) -> pb.StreamAccessLogsResponse:
        self.streams += 1
        if self.streams == 1:
            if self._none_since is None:
                log.info("access-log stream open: in-flight counts last until requests end")
            else:
                log.info(
                    "access-log stream open again after %.1f s without one",
                    self._clock() - self._none_since,
                )
                self._none_since = None
        it = aiter(requests)
        ending = asyncio.ensure_future(self._ending.wait())
        try:
            while not ending.done():
                # One read at a time, raced against `end()`: Envoy sends a batch per flush
                # interval, so the extra task per batch is noise.
                read = asyncio.ensure_future(anext(it))
                await asyncio.wait((read, ending), return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    read.cancel()
                    break
                try:
                    msg = read.result()
                except StopAsyncIteration:
                    break
                for entry in entries(msg):
                    self._ends.ended(entry)
        finally:
            ending.cancel()
            self.streams -= 1
            if not self._ending.is_set():
                self._lost()
        return pb.StreamAccessLogsResponse()

    def _lost(self) -> None:
        """The proxy closed a stream (or its connection went): counted; the last one said."""
        self.lost += 1
        if self.streams == 0 and self._none_since is None:
            self._none_since = self._clock()
            log.warning(
                "access-log stream lost, none open: request ends are not reported until the "
                "proxy reconnects; in-flight counts held for them last up to "
                "state.request_end.max_hold_s"
            )

    def end(self) -> None:
        """Answer and close every open stream, and any opened after (a proxy reconnecting to
        a draining picker)."""
        self._ending.set()

    def rpc_handler(self) -> grpc.GenericRpcHandler:
        method = grpc.stream_unary_rpc_method_handler(
            self.stream,
            request_deserializer=pb.StreamAccessLogsMessage.FromString,
            response_serializer=pb.StreamAccessLogsResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(SERVICE, {"StreamAccessLogs": method})
