"""llm-d's / GIE's metric families: names, types, buckets and labels as llm-d exposes them,
bounded label values, the request lifecycle, and the pool gauges."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from extproc.core import Endpoint, EndpointState
from extproc.server.llmd_metrics import (
    GENERAL_LATENCY_BUCKETS,
    MAX_LABEL_VALUES,
    BuildInfo,
    LlmdMetrics,
    PoolView,
    error_code,
)
from extproc.server.metric_stores import OVERFLOW_LABEL


def scrape(m: LlmdMetrics) -> dict:
    """{sample name: [(labels, value)]} and {family name: type} of one exposition."""

    class C(Collector):
        def collect(self):  # type: ignore[override]
            return m.collect()

    reg = CollectorRegistry()
    reg.register(C())
    text = generate_latest(reg).decode()
    samples: dict = {}
    types = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return {"samples": samples, "types": types, "text": text}


def value(out: dict, sample: str, /, **labels: str) -> float:
    return sum(v for lab, v in out["samples"].get(sample, []) if labels.items() <= lab.items())


def test_request_lifecycle_counts_with_llmd_labels() -> None:
    m = LlmdMetrics(BuildInfo("abc", "0.1.0"))
    r = m.request()
    r.routed("llama", {"x-gateway-inference-fairness-id": "team-a"}, 2048, 500)
    out = scrape(m)
    assert value(out, "llm_d_epp_request_running", model_name="llama", fairness_id="team-a") == 1
    assert value(out, "inference_objective_running_requests", model_name="llama") == 1
    r.response("503", "77")
    r.close()
    r.close()  # the stream ends once, however often it says so
    out = scrape(m)
    labels = {"model_name": "llama", "target_model_name": "llama", "fairness_id": "team-a",
              "priority": "0"}  # fmt: skip
    assert value(out, "llm_d_epp_request_total", **labels) == 1
    assert value(out, "inference_objective_request_total", model_name="llama") == 1
    assert value(out, "llm_d_epp_request_error_total", error_code="ModelServerError") == 1
    assert value(out, "inference_objective_request_error_total", error_code="ModelServerError") == 1
    assert value(out, "llm_d_epp_request_duration_seconds_count", **labels) == 1
    assert value(out, "inference_objective_request_sizes_bucket", le="2048") == 1
    assert value(out, "inference_objective_request_sizes_bucket", le="1024") == 0
    assert value(out, "inference_objective_response_sizes_sum") == 77
    assert value(out, "inference_objective_input_tokens_sum") == 500
    assert value(out, "llm_d_epp_request_running", **labels) == 0
    assert value(out, "llm_d_epp_info", commit="abc", build_ref="0.1.0") == 1
    assert value(out, "inference_extension_info", commit="abc", build_ref="0.1.0") == 1
    assert out["types"]["llm_d_epp_request"] == "counter"
    assert out["types"]["inference_objective_request_duration_seconds"] == "histogram"
    assert out["types"]["llm_d_epp_request_running"] == "gauge"


def test_refusals_follow_llmd_error_codes() -> None:
    m = LlmdMetrics()
    m.request().failed(400, None, {})  # body did not parse: an error, no request
    m.request().failed(503, "llama", {})  # nothing eligible after parsing: both
    out = scrape(m)
    assert value(out, "llm_d_epp_request_error_total", model_name="", error_code="BadRequest") == 1
    assert value(out, "llm_d_epp_request_error_total", model_name="llama",
                 error_code="ServiceUnavailable") == 1  # fmt: skip
    assert value(out, "llm_d_epp_request_total") == 1
    assert [error_code(s) for s in (400, 413, 404, 429, 500, 503, 418)] == [
        "BadRequest", "BadRequest", "NotFound", "ResourceExhausted", "Internal",
        "ServiceUnavailable", "BadRequest"]  # fmt: skip


def test_client_chosen_label_values_are_bounded() -> None:
    assert MAX_LABEL_VALUES == 1000  # llm-d's limit; a small one keeps the test fast
    limit = 20
    m = LlmdMetrics(label_limit=limit)
    for i in range(limit + 50):
        r = m.request()
        r.routed(f"model-{i}", {"x-llm-d-inference-fairness-id": f"f{i}"}, 10, 1)
        r.close()
    out = scrape(m)
    models = {lab["model_name"] for lab, _ in out["samples"]["llm_d_epp_request_total"]}
    assert len(models) == limit + 1 and OVERFLOW_LABEL in models
    assert value(out, "llm_d_epp_request_total", model_name=OVERFLOW_LABEL) == 50
    assert value(out, "llm_d_epp_request_total", fairness_id=OVERFLOW_LABEL) == 50


def test_buckets_are_llmds_and_le_is_written_as_go_writes_it() -> None:
    m = LlmdMetrics()
    r = m.request()
    r.routed("m", {}, 1 << 20, 1)
    r.close()
    m.scheduler_timer()(0.0002)  # exactly on a bound: counted in that bucket (le is <=)
    out = scrape(m)
    les = [lab["le"] for lab, _ in out["samples"]["llm_d_epp_request_duration_seconds_bucket"]]
    assert len(les) == len(GENERAL_LATENCY_BUCKETS) + 1
    assert les[:3] == ["0.005", "0.025", "0.05"] and "1" in les and les[-1] == "+Inf"
    assert 'le="1.048576e+06"' in out["text"]  # Go's %g form for large bounds
    assert value(out, "llm_d_epp_scheduler_e2e_duration_seconds_bucket", le="0.0002") == 1
    assert value(out, "llm_d_epp_scheduler_e2e_duration_seconds_bucket", le="0.0001") == 0
    assert value(out, "inference_extension_scheduler_e2e_duration_seconds_count") == 1


def test_scheduler_attempts_carry_the_first_picks_endpoint_labels() -> None:
    m = LlmdMetrics()
    m.attach_pool(PoolView("pool", "ns", lambda: (), None))
    m.scheduled("llama", Endpoint("10.0.0.7:8000", name="vllm-0"))
    m.scheduled("llama", None)
    out = scrape(m)
    assert value(out, "llm_d_epp_scheduler_attempts_total", status="success",
                 endpoint_name="vllm-0", namespace="ns", port="8000") == 1  # fmt: skip
    assert value(out, "inference_extension_scheduler_attempts_total", status="success",
                 pod_name="vllm-0") == 1  # fmt: skip
    assert value(out, "llm_d_epp_scheduler_attempts_total", status="failure") == 1


def test_pool_gauges_average_fresh_scrapes_and_are_absent_without_any() -> None:
    eps = (Endpoint("10.0.0.1:8000", name="a"), Endpoint("10.0.0.2:8000", name="b"),
           Endpoint("10.0.0.3:8000"))  # fmt: skip
    states = {
        "10.0.0.1:8000": EndpointState(waiting=2, running=4, kv_usage=0.2, is_stale=False),
        "10.0.0.2:8000": EndpointState(waiting=4, running=8, kv_usage=0.6, is_stale=False),
        "10.0.0.3:8000": EndpointState(waiting=99, kv_usage=0.99, is_stale=True),
    }
    m = LlmdMetrics()
    m.attach_pool(PoolView("vllm-pool", "ns", lambda: eps, states.__getitem__))
    out = scrape(m)
    assert value(out, "inference_pool_ready_pods", name="vllm-pool") == 3
    assert value(out, "llm_d_epp_ready_endpoints", name="vllm-pool") == 3
    assert abs(value(out, "inference_pool_average_kv_cache_utilization") - 0.4) < 1e-9
    assert value(out, "inference_pool_average_queue_size") == 3
    assert value(out, "llm_d_epp_average_running_requests") == 6
    assert value(out, "llm_d_epp_std_dev_queue_size") == 1
    per_pod = out["samples"]["inference_pool_per_pod_queue_size"]
    assert sorted((lab["model_server_pod"], v) for lab, v in per_pod) == [("a", 2), ("b", 4)]
    # Not scraped at all: KV and queue figures are unknown, so those gauges are absent.
    m.attach_pool(PoolView("vllm-pool", "ns", lambda: eps, None))
    out = scrape(m)
    assert value(out, "inference_pool_ready_pods") == 3
    assert "inference_pool_average_kv_cache_utilization" not in out["samples"]
    assert "inference_pool_per_pod_queue_size" not in out["samples"]


def test_build_info_is_the_package_version_and_the_commit_the_image_was_built_from() -> None:
    import importlib.metadata

    info = BuildInfo.installed({"EXTPROC_COMMIT": "0123abc"})
    assert info == BuildInfo("0123abc", importlib.metadata.version("extproc"))
    assert BuildInfo.installed({}).commit == "unknown"
