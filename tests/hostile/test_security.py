"""Security properties: the picker never fetches client-named URLs, prices media from headers
without decoding it, and never lets request content inject into the headers it sets."""

from __future__ import annotations

import base64
import struct
import zlib

import orjson
import pytest
from aiohttp import web

from extproc import protocol
from extproc.requests import ParseSettings, parse_request
from extproc.testing import ExtProcClient, body_chunks, destination, post, request_headers
from extproc.testing import response_headers as response_headers_msg
from tests.conftest import ENDPOINTS


def png(width: int, height: int, payload: bytes = b"") -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (
        b"\x89PNG\r\n\x1a\n"
        + struct.pack(">I", len(ihdr))
        + chunk
        + struct.pack(">I", zlib.crc32(chunk))
        + payload
    )


def chat_with_image(url: str) -> bytes:
    return orjson.dumps(
        {
            "model": "qwen2.5-vl",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                }
            ],
        }
    )


async def test_remote_media_urls_are_never_fetched(client: ExtProcClient, unused_tcp_port: int):
    hits: list[str] = []

    async def record(request: web.Request) -> web.Response:
        hits.append(request.path)
        return web.Response(body=png(64, 64))

    app = web.Application()
    app.router.add_get("/{tail:.*}", record)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", unused_tcp_port).start()
    try:
        url = f"http://127.0.0.1:{unused_tcp_port}/cat.png"
        out = await client.exchange(
            [request_headers(post("/v1/chat/completions")), *body_chunks(chat_with_image(url))]
        )
        assert destination(out[0]) in ENDPOINTS
    finally:
        await runner.cleanup()
    assert hits == []


def test_media_is_priced_from_the_header_without_decoding():
    """A huge image whose pixel data is garbage: decoding it would fail (or take seconds and
    gigabytes); pricing reads 24 header bytes."""
    bomb = png(12_000, 12_000, payload=b"\x00IDAT" + b"\xff" * 1000)
    uri = "data:image/png;base64," + base64.b64encode(bomb).decode()
    req = parse_request("/v1/chat/completions", {}, chat_with_image(uri), ParseSettings())
    (item,) = req.media
    assert (item.width, item.height) == (12_000, 12_000)
    # Priced at the model family's pixel cap, not at 144M pixels.
    assert 0 < item.tokens <= 20_000


def test_impossible_dimensions_are_a_clear_400():
    from extproc.errors import BadRequest

    lie = png(100_000, 100_000)
    uri = "data:image/png;base64," + base64.b64encode(lie).decode()
    with pytest.raises(BadRequest) as e:
        parse_request("/v1/chat/completions", {}, chat_with_image(uri), ParseSettings())
    assert "image" in e.value.message


@pytest.mark.parametrize("model", ["m\r\nx-evil: 1", "m\nx-evil: 1", "m\x00", "m\u2028evil"])
async def test_request_content_cannot_inject_into_headers_we_set(client: ExtProcClient, model):
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi\r\n"}]})
    headers = post("/v1/chat/completions", {protocol.EXPLAIN_HEADER: "1", "x-request-id": "r\r\n1"})
    call = client.open()
    await call.write(request_headers(headers))
    for m in body_chunks(body):
        await call.write(m)
    routed = await call.read()
    await call.read()
    await call.write(response_headers_msg(200))
    back = await call.read()
    await call.done_writing()
    set_headers = [
        *routed.request_headers.response.header_mutation.set_headers,
        *back.response_headers.response.header_mutation.set_headers,
    ]
    assert set_headers
    for opt in set_headers:
        value = opt.header.raw_value
        assert b"\r" not in value and b"\n" not in value and b"\x00" not in value, opt
        assert opt.header.key.islower() and ":" not in opt.header.key
