"""Where a gateway allows it (`allow_mode_override`, no FULL_DUPLEX_STREAMED body mode), the
picker's request-header reply asks Envoy to stop sending response bodies and trailers, and a
real Envoy obeys: a request with a streamed 10-chunk answer costs the picker 3 messages
(request headers, buffered body, response headers) instead of 14."""

from __future__ import annotations

from dataclasses import replace

import httpx
import orjson
import pytest

from extproc.gateways import AI_GATEWAY, gateway_bootstrap
from extproc.sim import echo
from extproc.stack import Stack, StackOptions

pytestmark = pytest.mark.e2e

SENT = "http.inference.ext_proc.stream_msgs_sent"


@pytest.mark.parametrize("allowed", [True, False], ids=["override-allowed", "not-allowed"])
def test_picker_asks_for_the_cheapest_response_mode(allowed: bool):
    gw = replace(
        AI_GATEWAY,
        name="buffered-streamed",
        request_body="BUFFERED",
        response_body="STREAMED",
        request_trailers=False,
        response_trailers=False,
        allow_mode_override=allowed,
    )
    body = orjson.dumps({"model": "m", "prompt": "override " * 20})
    chunks = 10
    with (
        Stack(StackOptions(upstreams=1, bootstrap=lambda o: gateway_bootstrap(gw, o))) as stack,
        httpx.Client(base_url=stack.url, timeout=30) as c,
    ):
        before = stack.envoy_stats(SENT).get(SENT, 0)
        r = c.post(
            "/v1/completions",
            content=body,
            headers={echo.CHUNKS_HEADER: str(chunks), echo.CHUNK_GAP_HEADER: "20"},
        )
        assert r.status_code == 200
        assert r.content.endswith(b"".join(echo.stream_chunk(i, 64) for i in range(chunks)))
        sent = stack.envoy_stats(SENT).get(SENT, 0) - before
    if allowed:
        assert sent == 3
    else:
        assert sent > 3 + chunks - 1  # every response chunk went to the picker too
