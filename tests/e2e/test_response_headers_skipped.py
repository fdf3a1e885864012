"""Issue 17: where the access log reports each request's end, `extproc envoy-config
--response-headers auto` leaves the response-header phase out, and a real Envoy then sends
the picker one message fewer per request. What the phase told the picker comes from the
access-log entry instead: the request end (in-flight counts), the status and body size
(llm-d's request families) and, where a fallback served the request, the served endpoint
(the index follows it)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from extproc.bootstrap import BootstrapOptions, build_bootstrap
from extproc.stack import Stack, StackOptions, free_port, wait_until

pytestmark = pytest.mark.e2e

SENT = "http.inference.ext_proc.stream_msgs_sent"


def metrics(stack: Stack, name: str) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{stack.picker_admin_port}/metrics", timeout=5).text
    return {
        m.group(1) or "": float(m.group(2))
        for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)
    }


def total(stack: Stack, name: str) -> float:
    return sum(metrics(stack, name).values())


def processing_mode(stack: Stack) -> dict:
    doc = yaml.safe_load((stack.log_dir / "envoy.yaml").read_text())
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (f,) = [f for f in hcm["typed_config"]["http_filters"] if "ext_proc" in f["name"]]
    return f["typed_config"]["processing_mode"]


N = 6


def run_requests(stack: Stack, c: httpx.Client) -> int:
    """N requests after the access-log stream is open; the messages Envoy sent the picker."""
    # A first request opens Envoy's access-log stream (auto mode holds once it exists).
    assert c.post("/v1/completions", json={"model": "m", "prompt": "warm"}).status_code == 200
    wait_until(
        lambda: total(stack, "extproc_access_log_entries_total") >= 1,
        timeout_s=10,
        what="the first access-log entry",
    )
    sent0 = stack.envoy_stats(SENT).get(SENT, 0)
    for i in range(N):
        r = c.post("/v1/completions", json={"model": "m", "prompt": f"skip {i} " * 40})
        assert r.status_code == 200
    return stack.envoy_stats(SENT).get(SENT, 0) - sent0


def test_auto_skips_response_headers_and_the_access_log_stands_in():
    n = N
    with (
        Stack(StackOptions(upstreams=1)) as stack,  # the default config keeps the phase
        httpx.Client(base_url=stack.url, timeout=30) as c,
    ):
        assert processing_mode(stack)["response_header_mode"] == "SEND"
        sent_with_phase = run_requests(stack, c)
    auto = StackOptions(
        upstreams=1, bootstrap=lambda o: build_bootstrap(replace(o, response_headers="auto"))
    )
    with Stack(auto) as stack, httpx.Client(base_url=stack.url, timeout=30) as c:
        assert processing_mode(stack)["response_header_mode"] == "SKIP"
        sizes0 = total(stack, "inference_objective_response_sizes_count")
        ended0 = total(stack, "extproc_request_end_ended_total")
        sent = run_requests(stack, c)
        # One message fewer per request: the response headers.
        assert sent == sent_with_phase - n, (sent, sent_with_phase)
        # Every request's end came from its access-log entry, with its status and size.
        wait_until(
            lambda: (
                total(stack, "extproc_request_end_ended_total") - ended0 == n
                and total(stack, "inference_objective_response_sizes_count") - sizes0 == n
            ),
            timeout_s=10,
            what="the access-log entries",
        )
        assert total(stack, "extproc_inflight_requests") == 0
        assert total(stack, "extproc_request_end_expired_total") == 0
        assert total(stack, "extproc_served_elsewhere_total") == 0


def test_forced_skip_with_a_fallback_moves_the_index_to_the_served_endpoint(tmp_path: Path):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: connect-failure, then the fallback
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text(yaml.safe_dump([dead]))
    config = tmp_path / "picker.yaml"
    # No scraping: the dead endpoint stays eligible, as a server that just died would be.
    config.write_text(yaml.safe_dump({"state": {"scrape": None}}))

    def bootstrap(opts: BootstrapOptions):
        return build_bootstrap(
            replace(opts, endpoints=(*opts.endpoints, dead), response_headers="skip")
        )

    opts = StackOptions(
        upstreams=1,
        lb="override-host",
        fallbacks=1,
        bootstrap=bootstrap,
        extproc_args=("--endpoints-file", str(endpoints), "--config", str(config)),
    )
    with Stack(opts) as stack, httpx.Client(base_url=stack.url, timeout=30) as c:
        assert processing_mode(stack)["response_header_mode"] == "SKIP"
        (live,) = stack.upstream_addresses
        endpoints.write_text(yaml.safe_dump([dead, live]))
        wait_until(lambda: total(stack, "extproc_endpoints") == 2, timeout_s=30, what="pool")
        assert c.post("/v1/completions", json={"model": "m", "prompt": "warm"}).status_code == 200
        wait_until(
            lambda: total(stack, "extproc_access_log_entries_total") >= 1,
            timeout_s=10,
            what="the first access-log entry",
        )
        moved: list[bytes] = []
        for i in range(16):
            if len(moved) >= 2:
                break
            before = total(stack, "extproc_served_elsewhere_total")
            ended = total(stack, "extproc_request_end_ended_total")
            body = orjson.dumps({"model": "m", "prompt": f"fallback {i} " * 60})
            r = c.post("/v1/completions", content=body)
            assert r.status_code == 200
            wait_until(
                lambda ended=ended: total(stack, "extproc_request_end_ended_total") > ended,
                timeout_s=10,
                what="the request's access-log entry",
            )
            if total(stack, "extproc_served_elsewhere_total") > before:
                moved.append(body)
        assert len(moved) >= 2, "no pick went to the dead endpoint in 16 requests"
        for body in moved:
            # The picker never saw the response headers, yet the served endpoint holds the
            # request's blocks in its index (the decision had recorded them on the pick).
            explained = httpx.post(
                f"http://127.0.0.1:{stack.picker_admin_port}/debug/explain",
                content=body,
                headers={"x-extproc-path": "/v1/completions"},
                timeout=10,
            ).json()
            assert explained["request_blocks"] > 0
            assert explained["prefix_blocks"].get(live, 0) == explained["request_blocks"]
        wait_until(
            lambda: total(stack, "extproc_inflight_requests") == 0,
            timeout_s=10,
            what="in-flight released on both endpoints",
        )
        assert total(stack, "extproc_request_end_expired_total") == 0
