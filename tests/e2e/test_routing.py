"""Through a real Envoy: requests land where extproc decided, and only there."""

from __future__ import annotations

import concurrent.futures
import hashlib

import httpx
import orjson

from extproc import protocol
from extproc.stack import Stack

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def upstream_requests(stack: Stack) -> int:
    return stack.envoy_stats("cluster.model_servers.upstream_rq_total").get(
        "cluster.model_servers.upstream_rq_total", 0
    )


def test_every_request_lands_on_the_endpoint_extproc_chose(stack: Stack, http: httpx.Client):
    served = []
    for _ in range(30):
        r = http.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        seen = r.json()
        # The upstream saw the picker's header naming itself: Envoy obeyed the decision.
        assert seen["destination_header"] == seen["endpoint"]
        served.append(seen["endpoint"])
    assert set(served) <= set(stack.upstream_addresses)
    assert len(set(served)) > 1, "idle endpoints tie; ties must spread"


def test_concurrent_requests_spread_over_all_endpoints(stack: Stack):
    def one(_):
        with httpx.Client(base_url=stack.url, timeout=30) as c:
            return c.post("/v1/chat/completions", json=CHAT).json()["endpoint"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        served = list(pool.map(one, range(48)))
    assert set(served) == set(stack.upstream_addresses)


def test_malformed_json_gets_400_and_reaches_no_upstream(stack: Stack, http: httpx.Client):
    before = upstream_requests(stack)
    r = http.post(
        "/v1/chat/completions",
        content=b'{"model": "m", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert upstream_requests(stack) == before


def test_spoofed_destination_header_is_ignored(stack: Stack, http: httpx.Client):
    rogue = stack.unlisted_addresses[0]
    for _ in range(10):
        r = http.post(
            "/v1/chat/completions", json=CHAT, headers={protocol.DESTINATION_HEADER: rogue}
        )
        assert r.status_code == 200
        assert r.json()["endpoint"] in stack.upstream_addresses
        assert r.json()["destination_header"] == r.json()["endpoint"]


def test_two_megabyte_body_passes_intact_in_full_duplex(stack: Stack, http: httpx.Client):
    body = orjson.dumps({"model": "m", "prompt": "lorem ipsum " * 175_000})
    assert len(body) > 2_000_000
    r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 200
    seen = r.json()
    assert seen["body_bytes"] == len(body)
    assert seen["body_sha256"] == hashlib.sha256(body).hexdigest()


def test_bodyless_get_is_routed(stack: Stack, http: httpx.Client):
    r = http.get("/v1/models")
    assert r.status_code == 200
    assert r.json()["endpoint"] in stack.upstream_addresses


def test_unknown_path_with_non_json_body_still_routes(stack: Stack, http: httpx.Client):
    r = http.post("/custom/endpoint", content=b"\x00\x01 not json")
    assert r.status_code == 200
    assert r.json()["endpoint"] in stack.upstream_addresses
