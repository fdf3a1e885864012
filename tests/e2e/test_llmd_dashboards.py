"""llm-d's and GIE's published dashboards show data for `extproc serve` behind Envoy.

Real traffic goes through Envoy to simulated vLLM servers; the picker's /metrics (and the
servers') are scraped the way a ServiceMonitor scrape stores them, and every Prometheus query
of the two dashboards in tests/fixtures/dashboards/ is checked: each query about the endpoint
picker must find series, with the labels it groups by. The few it cannot find are listed in
NO_EQUIVALENT with the reason, and the test checks they really are absent (so the list cannot
go stale in either direction).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extproc.stack import Stack, StackOptions, wait_until
from tests.dashboards import Query, Series, finds_data, load_queries, scrape_series

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "dashboards"
DASHBOARDS = ("inference_gateway.json", "llm-d-failure-saturation-dashboard.json")
NAMESPACE = "inference"
# Picker metrics the dashboards query that extproc does not export, and why.
NO_EQUIVALENT = {
    "inference_objective_output_tokens_bucket": (
        "output tokens are in the response body, which the picker never sees "
        "(response_body_mode NONE)"
    ),
}
# Queries about scrape targets rather than any exporter's series.
DEPLOYMENT_SPECIFIC = {
    "up": "Prometheus's own series; the dashboard hard-codes llm-d's guide job name "
    "(gaie-optimized-baseline-epp), a ServiceMonitor for extproc yields job=extproc",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Scraped figures count as fresh for 5 s instead of 0.2 s: on a loaded test machine the
    # picker's loop can lag past 0.2 s, and the pool gauges (fresh figures only) would blink.
    cfg = tmp_path_factory.mktemp("llmd") / "extproc.yaml"
    cfg.write_text("state:\n  scrape:\n    stale_after_s: 5\n")
    opts = StackOptions(
        upstreams=2,
        sim_args=("--fast", "50", "--chat-max-tokens", "8"),
        extproc_args=("--config", str(cfg)),
    )
    with Stack(opts) as s:
        yield s


def _chat(model: str, text: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 8}


def _send_traffic(stack: Stack) -> None:
    assert stack.fleet is not None
    model = stack.fleet.model
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        for i in range(12):
            r = http.post("/v1/chat/completions", json=_chat(model, f"hello number {i} " * 20))
            assert r.status_code == 200, r.text
        r = http.post(
            "/v1/chat/completions",
            json=_chat(model, "from a tenant"),
            headers={"x-gateway-inference-fairness-id": "tenant-a"},
        )
        assert r.status_code == 200
        # Streamed: no content-length, so no response size is observed for it.
        body = {**_chat(model, "stream me"), "stream": True}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200 and "content-length" not in r.headers
            r.read()
        # Routed, then refused by the server (the simulator serves n=1 only): an error of
        # the model, llm-d's ModelServerError.
        r = http.post("/v1/chat/completions", json={**_chat(model, "twice"), "n": 2})
        assert r.status_code == 400
        # A body that does not parse: refused by the picker, an error with no model.
        r = http.post(
            "/v1/chat/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert r.status_code == 400


def _series(stack: Stack) -> list[Series]:
    """Picker and model servers as Prometheus would store them after one scrape each."""
    picker_target = {"namespace": NAMESPACE, "job": "extproc", "pod": "extproc-0",
                     "instance": f"127.0.0.1:{stack.picker_admin_port}"}  # fmt: skip
    text = httpx.get(f"http://127.0.0.1:{stack.picker_admin_port}/metrics", timeout=5).text
    series = scrape_series(text, picker_target)
    series.append(Series("up", picker_target, 1.0))
    assert stack.fleet is not None
    for i, address in enumerate(stack.fleet.addresses):
        target = {"namespace": NAMESPACE, "job": "vllm", "pod": f"vllm-{i}", "instance": address}
        series += scrape_series(httpx.get(f"http://{address}/metrics", timeout=5).text, target)
    return series


def _pool_gauges_present(stack: Stack) -> bool:
    text = httpx.get(f"http://127.0.0.1:{stack.picker_admin_port}/metrics", timeout=5).text
    return "inference_pool_average_kv_cache_utilization{" in text


def test_dashboard_queries_find_data_in_a_live_scrape(stack: Stack) -> None:
    _send_traffic(stack)
    # Pool gauges need a fresh scrape of the servers (every 50 ms by default).
    wait_until(lambda: _pool_gauges_present(stack), timeout_s=10, what="pool gauges")
    series = _series(stack)
    assert stack.fleet is not None
    variables = {"namespace": NAMESPACE, "model_name": stack.fleet.model,
                 "__rate_interval": "1m", "DS_PROMETHEUS": "prometheus"}  # fmt: skip
    queries: list[Query] = []
    for name in DASHBOARDS:
        queries += load_queries(FIXTURES / name, variables)

    picker = [q for q in queries if q.about_picker]
    found, absent, wrong = [], [], []
    for q in picker:
        missing = finds_data(q, series)
        expected_absent = {s.metric for s in q.selectors} & NO_EQUIVALENT.keys()
        if expected_absent:
            # Declared absent: it must really be absent (else drop it from NO_EQUIVALENT).
            (absent if missing else wrong).append((q.label, missing))
        elif missing:
            wrong.append((q.label, missing))
        else:
            found.append(q.label)
    others = [q for q in queries if not q.about_picker]
    other_found = [q.label for q in others if not finds_data(q, series)]
    print(f"\npicker queries: {len(picker)}, find data: {len(found)}, "
          f"no equivalent: {len(absent)}; other queries: {len(others)}, "
          f"find data: {len(other_found)}")  # fmt: skip
    for label, why in absent:
        print(f"  no equivalent: {label}: {why}")
    for q in others:
        if q.label not in other_found:
            print(f"  not the picker's, no data: {q.label}: {q.expr}")
    assert not wrong, "\n".join(f"{label}: {why}" for label, why in wrong)
    # Both dashboards have picker panels and all but the declared ones show data.
    assert len(found) >= 25
    # The failure dashboard's scheduler-health panel selects Prometheus's `up` by llm-d's job
    # name: it finds nothing unless the picker's Service is named like llm-d's.
    up = [q for q in others if any(s.metric == "up" for s in q.selectors)]
    assert len(up) == 1 and finds_data(up[0], series)
    assert DEPLOYMENT_SPECIFIC.keys() == {"up"}


def _value(series: list[Series], name: str, **labels: str) -> float:
    def wanted(s: Series) -> bool:
        return s.name == name and all(s.labels.get(k) == v for k, v in labels.items())

    return sum(s.value for s in series if wanted(s))


def _idle(stack: Stack) -> bool:
    running = [s.value for s in _series(stack) if s.name == "llm_d_epp_request_running"]
    return bool(running) and all(v == 0 for v in running)


def test_the_figures_count_what_was_sent(stack: Stack) -> None:
    """Not just present: the counters count this test's requests, with llm-d's labels."""
    assert stack.fleet is not None
    model = stack.fleet.model
    before = _series(stack)
    _send_traffic(stack)
    # Envoy ends each ext_proc stream after the response headers, possibly a moment after the
    # client has its (short, unstreamed) response: wait for the last one.
    wait_until(lambda: _idle(stack), timeout_s=10, what="streams to end")
    after = _series(stack)

    def delta(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert delta("llm_d_epp_request_total", model_name=model, fairness_id="default-flow") == 14
    assert delta("llm_d_epp_request_total", model_name=model, fairness_id="tenant-a") == 1
    assert delta("inference_objective_request_total", model_name=model,
                 target_model_name=model) == 15  # fmt: skip
    assert delta("llm_d_epp_request_error_total", model_name="", error_code="BadRequest") == 1
    assert delta("llm_d_epp_request_error_total", model_name=model,
                 error_code="ModelServerError") == 1  # fmt: skip
    assert delta("llm_d_epp_request_duration_seconds_count", model_name=model) == 15
    assert delta("inference_objective_request_sizes_count", model_name=model) == 15
    assert delta("inference_objective_response_sizes_count", model_name=model) == 14
    assert delta("llm_d_epp_scheduler_e2e_duration_seconds_count") == 15
    assert delta("llm_d_epp_scheduler_attempts_total", status="success") == 15
    # Every plugin of the default profile is timed once per decision.
    plugin_types = {s.labels["plugin_type"] for s in after
                    if s.name == "llm_d_epp_plugin_duration_seconds_count"}  # fmt: skip
    # The default profile's plugins (whatever they are today): scorers, the picker, the handler.
    extension_points = {s.labels["extension_point"] for s in after
                        if s.name == "llm_d_epp_plugin_duration_seconds_count"}  # fmt: skip
    assert {"Scorer", "Picker", "ProfilePicker"} <= extension_points
    for t in plugin_types:
        assert delta("llm_d_epp_plugin_duration_seconds_count", plugin_type=t) == 15, t
    # Nothing is running once the responses are back; the pool is the two servers.
    running = [s.value for s in after if s.name == "llm_d_epp_request_running"]
    assert running and all(v == 0 for v in running)
    assert _value(after, "inference_pool_ready_pods") == 2
    assert _value(after, "llm_d_epp_info") == 1
