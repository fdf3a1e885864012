"""One endpoint's `/metrics` over a kept-alive HTTP/1.1 connection, at the cost of a few
callbacks per scrape.

The scrape loop asks every endpoint 20 times a second. A general HTTP client spends most of
a scrape in its own machinery (request and response objects, header multidicts, tracing
hooks, timers): ~0.6 ms of CPU per scrape against ~0.05 ms to read the body
(bench/bench_scrape.py). A metrics GET needs none of it: the request is the same bytes every
time, and the answer is a status line, a length (or chunks) and a body. So `MetricsFetcher`
writes the prebuilt request on its connection and an `asyncio.Protocol` collects the answer.

What it accepts: `200` with `Content-Length`, chunked, or close-delimited bodies, up to
`max_body_bytes`; anything else (another status, a redirect, an encoding we did not ask
for, a malformed head) is a `FetchError`. After any failure or cancellation the connection
is dropped, so a half-read answer can never be taken for the next one. `https` runs the
same exchange over TLS (`tls_context`).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Literal, cast

_HEAD_LIMIT = 64 << 10  # a status line and headers longer than this are not a metrics answer


class FetchError(Exception):
    """The endpoint's answer is not a usable metrics body."""


class _Answer(asyncio.Protocol):
    """Reads one answer at a time off the connection."""

    def __init__(self, max_body: int) -> None:
        self.max_body = max_body
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.waiter: asyncio.Future[bytes] | None = None
        self.keep_alive = True
        self._buf = bytearray()
        self._head_done = False
        self._length: int | None = None  # Content-Length, None: chunked or until close
        self._chunked = False
        self._body = bytearray()  # a chunked body, decoded

    def expect(self, waiter: asyncio.Future[bytes]) -> None:
        self.waiter = waiter
        self._buf.clear()
        self._head_done = False
        self._length = None
        self._chunked = False
        self._body = bytearray()
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        w = self.waiter
        if w is None or w.done():
            return
        if self._head_done and self._length is None and not self._chunked:
            self._finish(bytes(self._buf))  # a close-delimited body ends here
        else:
            w.set_exception(FetchError("connection closed before the answer was complete"))

    def data_received(self, data: bytes) -> None:
        w = self.waiter
        if w is None or w.done():
            self._fail("data while no answer was expected")
            return
        buf = self._buf
        buf += data
        try:
            if not self._head_done and not self._read_head():
                return
            if self._chunked:
                self._read_chunks()
            elif self._length is not None:
                if len(buf) >= self._length:
                    if len(buf) > self._length:
                        raise FetchError("more bytes than Content-Length")
                    self._finish(bytes(buf))
            elif len(buf) > self.max_body:
                raise FetchError(f"body over {self.max_body} bytes")
        except FetchError as exc:
            self._fail(exc)

    def _read_head(self) -> bool:
        buf = self._buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > _HEAD_LIMIT:
                raise FetchError("answer head too long")
            return False
        lines = bytes(buf[:end]).split(b"\r\n")
        del buf[: end + 4]
        status = lines[0].split(None, 2)
        if len(status) < 2 or not status[0].startswith(b"HTTP/1."):
            raise FetchError(f"not an HTTP/1.x answer: {lines[0][:60]!r}")
        if status[1] != b"200":
            raise FetchError(f"HTTP {status[1].decode('ascii', 'replace')}")
        if status[0] == b"HTTP/1.0":
            self.keep_alive = False
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep:
                raise FetchError(f"malformed header line: {line[:60]!r}")
            name, value = name.strip().lower(), value.strip()
            if name == b"content-length":
                if not value.isdigit():
                    raise FetchError(f"bad Content-Length: {value[:20]!r}")
                self._length = int(value)
                if self._length > self.max_body:
                    raise FetchError(f"body of {self._length} bytes")
            elif name == b"transfer-encoding":
                if value.lower() != b"chunked":
                    raise FetchError(f"transfer encoding {value[:20]!r} not supported")
                self._chunked = True
            elif name == b"content-encoding" and value.lower() not in (b"identity", b""):
                raise FetchError(f"content encoding {value[:20]!r} was not asked for")
            elif name == b"connection" and value.lower() == b"close":
                self.keep_alive = False
        if self._chunked:
            self._length = None
        elif self._length is None:
            self.keep_alive = False  # the body ends when the server closes
        self._head_done = True
        return True

    def _read_chunks(self) -> None:
        buf, body = self._buf, self._body
        while True:
            eol = buf.find(b"\r\n")
            if eol < 0:
                if len(buf) > 1024:
                    raise FetchError("chunk size line too long")
                return
            size_text = bytes(buf[:eol]).split(b";", 1)[0].strip()
            try:
                size = int(size_text, 16)
            except ValueError:
                raise FetchError(f"bad chunk size: {size_text[:20]!r}") from None
            if size == 0:
                # The last chunk: an empty line, or trailers and then an empty line.
                rest = bytes(buf[eol + 2 :])
                if rest.startswith(b"\r\n") or b"\r\n\r\n" in rest:
                    self._finish(bytes(body))
                elif len(rest) > _HEAD_LIMIT:
                    raise FetchError("trailers too long")
                return
            if len(buf) < eol + 2 + size + 2:
                if len(body) + size > self.max_body:
                    raise FetchError(f"body over {self.max_body} bytes")
                return
            body += buf[eol + 2 : eol + 2 + size]
            if len(body) > self.max_body:
                raise FetchError(f"body over {self.max_body} bytes")
            del buf[: eol + 2 + size + 2]

    def _finish(self, body: bytes) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(body)

    def _fail(self, exc: FetchError | str) -> None:
        err = exc if isinstance(exc, FetchError) else FetchError(exc)
        self.keep_alive = False
        w = self.waiter
        if w is not None and not w.done():
            w.set_exception(err)
        if self.transport is not None:
            self.transport.close()


def tls_context(verify: bool, ca_file: str | None = None) -> ssl.SSLContext:
    """The client context of an https scrape. Unverified by default, as llm-d's scraper
    (`insecureSkipVerify` defaults to true): model servers mostly serve self-signed
    certificates made at start, and their metrics are not secrets. `verify` checks the
    chain (against `ca_file`, else the system's CAs) and the endpoint's address."""
    ctx = ssl.create_default_context(cafile=ca_file)
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class MetricsFetcher:
    """GETs `path` from `address` (`host:port`) on one kept-alive connection. One fetch at a
    time (the scrape loop never overlaps two on one endpoint); bound each call with a
    timeout (`asyncio.timeout`): a cancelled fetch drops the connection."""

    def __init__(
        self,
        address: str,
        path: str = "/metrics",
        *,
        scheme: Literal["http", "https"] = "http",
        max_body_bytes: int = 16 << 20,
        tls_verify: bool = False,
        tls_ca_file: str | None = None,
    ) -> None:
        host, _, port = address.rpartition(":")
        self._host = host.strip("[]")
        self._port = int(port)
        self._ssl = tls_context(tls_verify, tls_ca_file) if scheme == "https" else None
        self._max_body = max_body_bytes
        self._request = (
            f"GET {path} HTTP/1.1\r\nHost: {address}\r\nUser-Agent: extproc\r\n"
            # Plain text: gzip saves nothing on a LAN and costs CPU at 20 scrapes/s; and no
            # OpenMetrics negotiation, so the body is classic Prometheus text.
            "Accept: text/plain;version=0.0.4\r\nAccept-Encoding: identity\r\n\r\n"
        ).encode("ascii")
        self._conn: _Answer | None = None
        self.connects = 0  # connections opened (a kept-alive one serves many fetches)

    async def fetch(self) -> bytes:
        conn = self._conn
        if conn is None or conn.closed or conn.transport is None or conn.transport.is_closing():
            conn = await self._connect()
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[bytes] = loop.create_future()
        conn.expect(waiter)
        assert conn.transport is not None
        conn.transport.write(self._request)
        try:
            body = await waiter
        except BaseException:
            self.close()  # a half-read answer must not be taken for the next one
            raise
        finally:
            conn.waiter = None
        if not conn.keep_alive:
            self.close()
        return body

    async def _connect(self) -> _Answer:
        self.close()
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(
            lambda: _Answer(self._max_body),
            self._host,
            self._port,
            ssl=self._ssl,
            server_hostname=self._host if self._ssl is not None else None,
        )
        self.connects += 1
        self._conn = conn
        return conn

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and conn.transport is not None:
            conn.transport.close()
