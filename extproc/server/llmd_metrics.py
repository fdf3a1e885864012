"""llm-d's and GIE's endpoint-picker metrics, under their names, types, buckets and labels, so
the dashboards and alerts written for llm-d's router keep working against extproc.

Every family is exported twice: under llm-d's current `llm_d_epp_*` name, and under the older
GIE name (`inference_objective_*`, `inference_pool_*`, `inference_extension_*`) that published
dashboards still query, each with the label set its original has. The figures come from the
events extproc already has: a stream's decision, its failure, its response headers and its end
(`RequestMetrics`, one per stream), scheduler and plugin timing (`scheduling/timing.py` calls
`scheduler_timer` / `plugin_timer`), and, at scrape time, the pool and its scraped state.

Hot-path cost: the histograms and counters (metric_stores.py) are plain dicts and lists, a
bisect and two adds per observation, turned into families only when Prometheus scrapes.
Label values that come from clients (model name, fairness id) are bounded: after 1,000
distinct values new ones are reported as "other", as llm-d does, so a client cannot grow the
exposition without limit.

What extproc cannot report (output tokens, TTFT, per-token latencies) is not exported at
all rather than faked, and flow control's llm-d names are not mapped yet;
docs/llm-d.md#metrics lists each family and why.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from extproc import __version__
from extproc.core import Endpoint, EndpointState
from extproc.protocol import FAIRNESS_HEADERS
from extproc.server.metric_stores import (
    BoundedLabel,
    Counter,
    Histogram,
    Key,
    add,
    gauge_family,
    merge,
)

# --- buckets, as llm-d defines them ---------------------------------------------------------

GENERAL_LATENCY_BUCKETS = (
    0.005, 0.025, 0.05, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 1.25, 1.5, 2, 3, 4, 5, 6, 8, 10, 15, 20,
    30, 45, 60, 120, 180, 240, 300, 360, 480, 600, 900, 1200, 1800, 2700, 3600,
)  # fmt: skip
SCHEDULING_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)
PROCESSING_BUCKETS = (
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.015, 0.025, 0.04, 0.06, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
)  # fmt: skip
REQUEST_SIZE_BUCKETS = tuple(2**i for i in range(6, 31))  # 64 B .. 1 GiB
RESPONSE_SIZE_BUCKETS = (
    1,
    8,
    16,
    32,
    64,
    128,
    256,
    512,
    1024,
    2048,
    4096,
    8192,
    16384,
    32778,
    65536,
)  # fmt: skip  (32778 is llm-d's value, kept so `le` labels match)
TOKEN_BUCKETS = (*RESPONSE_SIZE_BUCKETS, 131072, 262144, 524288, 1048576)

# --- label conventions ----------------------------------------------------------------------

DEFAULT_FAIRNESS_ID = "default-flow"
# extproc has no InferenceObjective priorities: every request is llm-d's default priority.
PRIORITY = "0"
MAX_LABEL_VALUES = 1000

# HTTP status of a refusal -> llm-d's canonical error code.
_ERROR_CODES = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    412: "PreconditionFailed",
    413: "BadRequest",
    429: "ResourceExhausted",
    503: "ServiceUnavailable",
}
MODEL_SERVER_ERROR = "ModelServerError"


def error_code(status: int) -> str:
    if status in _ERROR_CODES:
        return _ERROR_CODES[status]
    return "BadRequest" if 400 <= status < 500 else "Internal"


class _Series:
    """One request label set's histogram storage, resolved once per label set."""

    __slots__ = ("duration", "request_size", "response_size", "tokens")

    def __init__(self, m: LlmdMetrics, key: Key) -> None:
        self.duration = m.duration.slot(key)
        self.request_size = m.request_sizes.slot(key)
        self.response_size = m.response_sizes.slot(key)
        self.tokens = m.input_tokens.slot(key)


def _models(key: Key) -> Key:
    return key[:2]


def _model_only(key: Key) -> Key:
    return key[:1]


# --- the pool, as the collector sees it --------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PoolView:
    """What the pool gauges read at scrape time. `states` is None when metrics are not scraped
    (then KV and queue figures are unknown and their gauges are absent, not zero)."""

    name: str
    namespace: str
    endpoints: Callable[[], Sequence[Endpoint]]
    states: Callable[[str], EndpointState] | None


def endpoint_labels(e: Endpoint, namespace: str) -> Key:
    """(name, namespace, port) of an endpoint: its pod name when discovery knows it, else its
    address."""
    host, _, port = e.address.rpartition(":")
    return (e.name or host, namespace, port)


@dataclass(frozen=True, slots=True)
class BuildInfo:
    """The info metric's labels. The package version is the build ref; the commit is only
    known when the image build passes it (`EXTPROC_COMMIT`), else "unknown"."""

    commit: str
    build_ref: str

    @classmethod
    def installed(cls, environ: Mapping[str, str] | None = None) -> BuildInfo:
        commit = (environ or {}).get("EXTPROC_COMMIT", "") or "unknown"
        return cls(commit=commit, build_ref=__version__)


# --- the metrics -------------------------------------------------------------------------------


class LlmdMetrics:
    """The llm-d / GIE families of one picker process."""

    def __init__(
        self, build: BuildInfo | None = None, *, label_limit: int = MAX_LABEL_VALUES
    ) -> None:
        self.build = build or BuildInfo.installed()
        self.models = BoundedLabel(label_limit)
        self.fairness = BoundedLabel(label_limit)
        self.requests = Counter()
        self.errors = Counter()  # key: request key + error_code
        self.running: dict[Key, float] = {}
        self.duration = Histogram(GENERAL_LATENCY_BUCKETS)
        self.request_sizes = Histogram(REQUEST_SIZE_BUCKETS)
        self.response_sizes = Histogram(RESPONSE_SIZE_BUCKETS)
        self.input_tokens = Histogram(TOKEN_BUCKETS)
        self.processing = Histogram(PROCESSING_BUCKETS)
        self.scheduler_e2e = Histogram(SCHEDULING_BUCKETS)
        self.attempts = Counter()  # status, target_model_name, endpoint name, namespace, port
        self.plugins = Histogram(SCHEDULING_BUCKETS)  # extension_point, plugin_type, plugin_name
        self.namespace = ""
        self.series: dict[Key, _Series] = {}  # bounded: keys are bounded label values
        self._pool: PoolView | None = None
        self._observe_e2e = self.scheduler_e2e.child(())
        self.observe_processing = self.processing.child(())

    def attach_pool(self, view: PoolView) -> None:
        self._pool = view
        self.namespace = view.namespace

    # --- hot path ---

    def request(self) -> RequestMetrics:
        """One per ext_proc stream, created when it opens (= request received)."""
        return RequestMetrics(self)

    def plugin_timer(self, extension_point: str, plugin_type: str, plugin_name: str):
        return self.plugins.child((extension_point, plugin_type, plugin_name))

    def scheduler_timer(self) -> Callable[[float], None]:
        return self._observe_e2e

    def scheduled(self, model: str, endpoint: Endpoint | None) -> None:
        """One scheduling attempt: its first pick, or None when nothing was eligible."""
        target = self.models(model)
        if endpoint is None:
            self.attempts.inc(("failure", target, "", "", ""))
        else:
            self.attempts.inc(("success", target, *endpoint_labels(endpoint, self.namespace)))

    def key(self, model: str, headers: Mapping[str, str]) -> Key:
        fairness = DEFAULT_FAIRNESS_ID
        for h in FAIRNESS_HEADERS:
            v = headers.get(h)
            if v:
                fairness = self.fairness(v)
                break
        m = self.models(model)
        # extproc does not rewrite models: the target is the model the request names.
        return (m, m, fairness, PRIORITY)

    # --- scrape time ---

    def collect(self) -> Iterator:
        yield from self._request_families()
        yield from self._scheduling_families()
        info = {(self.build.commit, self.build.build_ref): 1.0}
        doc = "General information of the current build of the endpoint picker."
        for name in ("llm_d_epp_info", "inference_extension_info"):
            yield gauge_family(name, doc, ("commit", "build_ref"), info)
        if self._pool is not None:
            yield from pool_families(self._pool)

    def _request_families(self) -> Iterator:
        llmd = ("model_name", "target_model_name", "fairness_id", "priority")
        legacy = ("model_name", "target_model_name")
        doc = "Requests whose body parsed (routed, or refused after parsing)."
        yield self.requests.family("llm_d_epp_request", doc, llmd)
        yield self.requests.family("inference_objective_request", doc, legacy, _models)
        doc = "Requests that failed: refused by the picker, or answered non-200 by the server."
        yield self.errors.family("llm_d_epp_request_error", doc, (*llmd, "error_code"))
        yield self.errors.family(
            "inference_objective_request_error",
            doc,
            (*legacy, "error_code"),
            lambda k: (k[0], k[1], k[4]),
        )
        for store, new, old, doc in (
            (self.duration, "request_duration_seconds", "request_duration_seconds",
             "Request received to ext_proc stream end: the last response chunk when the "
             "gateway sends response bodies, else the response headers, seconds."),
            (self.request_sizes, "request_size_bytes", "request_sizes",
             "Request body size, bytes."),
            (self.response_sizes, "response_size_bytes", "response_sizes",
             "Response body size from the server's content-length (unsized responses are "
             "not observed), bytes."),
            (self.input_tokens, "request_input_tokens", "input_tokens",
             "Prompt tokens as the picker counted them (tokenizer in precise mode, else its "
             "estimate)."),
        ):  # fmt: skip
            yield store.family(f"llm_d_epp_{new}", doc, llmd)
            yield store.family(f"inference_objective_{old}", doc, legacy, _models)
        doc = "Requests routed whose ext_proc stream has not ended."
        yield gauge_family("llm_d_epp_request_running", doc, llmd, self.running)
        yield gauge_family(
            "inference_objective_running_requests",
            doc,
            ("model_name",),
            merge(self.running, _model_only),
        )

    def _scheduling_families(self) -> Iterator:
        doc = "Scheduling time (profile handler, filters, scorers, picker), seconds."
        for prefix in ("llm_d_epp", "inference_extension"):
            yield self.scheduler_e2e.family(f"{prefix}_scheduler_e2e_duration_seconds", doc, ())
        doc = "Scheduling attempts by outcome and first pick."
        yield self.attempts.family(
            "llm_d_epp_scheduler_attempts",
            doc,
            ("status", "target_model_name", "endpoint_name", "namespace", "port"),
        )
        yield self.attempts.family(
            "inference_extension_scheduler_attempts",
            doc,
            ("status", "target_model_name", "pod_name", "namespace", "port"),
        )
        doc = "Time of one plugin call by extension point, plugin type and name, seconds."
        labels = ("extension_point", "plugin_type", "plugin_name")
        for prefix in ("llm_d_epp", "inference_extension"):
            yield self.plugins.family(f"{prefix}_plugin_duration_seconds", doc, labels)
        yield self.processing.family(
            "llm_d_epp_request_processing_duration_seconds",
            "Request received to decision sent (headers and body handled), seconds.",
            (),
        )


def pool_families(view: PoolView) -> Iterable:
    """Pool gauges (`name` = the pool) from the endpoints and their scraped state."""
    endpoints = view.endpoints()
    pool = (view.name,)
    ready = {pool: float(len(endpoints))}
    doc = "Endpoints in the pool (discovery lists only Ready pods)."
    yield gauge_family("llm_d_epp_ready_endpoints", doc, ("name",), ready)
    yield gauge_family("inference_pool_ready_pods", doc, ("name",), ready)
    if view.states is None or not endpoints:
        return
    states = [(e, view.states(e.address)) for e in endpoints]
    fresh = [(e, s) for e, s in states if not s.is_stale]
    per_pod = {(view.name, endpoint_labels(e, view.namespace)[0]): float(s.waiting)
               for e, s in fresh}  # fmt: skip
    doc = "Requests waiting in each model server's queue (last fresh scrape)."
    yield gauge_family(
        "inference_pool_per_pod_queue_size", doc, ("name", "model_server_pod"), per_pod
    )
    yield gauge_family(
        "llm_d_epp_per_endpoint_queue_size", doc, ("name", "model_server_endpoint"), per_pod
    )
    if not fresh:
        return  # no fresh figures: averages would describe nothing
    for field, what in (("kv_usage", "kv_cache_utilization"), ("waiting", "queue_size"),
                        ("running", "running_requests")):  # fmt: skip
        values = [float(getattr(s, field)) for _, s in fresh]
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        doc = f"Mean {what.replace('_', ' ')} over the pool's freshly scraped endpoints."
        yield gauge_family(f"llm_d_epp_average_{what}", doc, ("name",), {pool: mean})
        yield gauge_family(f"inference_pool_average_{what}", doc, ("name",), {pool: mean})
        doc = f"Standard deviation of {what.replace('_', ' ')} over the same endpoints."
        yield gauge_family(f"llm_d_epp_std_dev_{what}", doc, ("name",), {pool: std})


class RequestMetrics:
    """One stream's share of the request families; every method is safe to call in any order
    and more than once (the stream ends however it ends)."""

    __slots__ = ("_done", "_key", "_m", "_resp_bytes", "_series", "_server_error", "_start")

    def __init__(self, m: LlmdMetrics) -> None:
        self._m = m
        self._start = time.perf_counter()
        self._key: Key | None = None
        self._series: _Series | None = None
        self._resp_bytes: int | None = None
        self._server_error = False
        self._done = False

    def routed(self, model: str, headers: Mapping[str, str], body_bytes: int,
               prompt_tokens: int) -> None:  # fmt: skip
        m = self._m
        if self._key is not None:  # a second request on one stream: close the first
            self.close()
            self._done = False
            self._start = time.perf_counter()
        key = self._key = m.key(model, headers)
        series = self._series = m.series.get(key)
        if series is None:
            series = self._series = m.series[key] = _Series(m, key)
        m.requests.inc(key)
        m.running[key] = m.running.get(key, 0.0) + 1
        add(m.request_sizes.bounds, series.request_size, body_bytes)
        if prompt_tokens > 0:
            add(m.input_tokens.bounds, series.tokens, prompt_tokens)
        m.observe_processing(time.perf_counter() - self._start)

    def failed(self, status: int, model: str | None, headers: Mapping[str, str]) -> None:
        """The picker refused the request. `model` is None when the body never parsed (then,
        as in llm-d, the error counts but no request does)."""
        m = self._m
        if self._key is not None:
            key = self._key
        else:
            key = m.key(model or "", headers)
            if model is not None:
                m.requests.inc(key)
        m.errors.inc((*key, error_code(status)))

    def response(self, status: str | None, content_length: str | None) -> None:
        self._server_error = status != "200"
        if content_length and content_length.isascii() and content_length.isdigit():
            self._resp_bytes = int(content_length)

    def close(self) -> None:
        key, series = self._key, self._series
        if key is None or series is None or self._done:
            return
        self._done = True
        m = self._m
        m.running[key] -= 1
        add(m.duration.bounds, series.duration, time.perf_counter() - self._start)
        if self._resp_bytes is not None:
            add(m.response_sizes.bounds, series.response_size, self._resp_bytes)
        if self._server_error:
            m.errors.inc((*key, MODEL_SERVER_ERROR))
