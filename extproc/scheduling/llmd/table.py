"""How each llm-d plugin type is realised in extproc, in one place.

Four outcomes, checked in this order by `llmd.translate`:
- **implemented**: the type is in the plugin registry (built-ins and entry points). A real
  plugin registered under a name listed below always wins over the table.
- **mapped**: data plumbing extproc does itself (parsers, metric scrapers, KV-block index
  producers, the tokenizer); `MAPPED` says which built-in machinery the type turns on and
  decodes llm-d's parameters strictly (see `llmd.mapped`).
- **pending**: built in another issue; `check-config` says which one and exits non-zero.
- **refused**: test-only plugins of llm-d's own loader tests, and behaviour extproc lacks,
  each with the reason.
"""

from __future__ import annotations

# Plugin types whose behaviour is being built in parallel: predicted latency (issue 16), and
# the flow-control types issue 15 did not build (its detectors, policies and admitters are
# found first, as flow control's own types). When they land, the registry (or flow
# control) finds them before this table; the names are then removed here.
PENDING_TYPES: dict[str, int] = {
    # predicted latency
    "predicted-latency-scorer": 16,  # GIE v1.5's name
    "slo-aware-profile-handler": 16,  # GIE v1.x
}

# Parameter values of implemented plugins that need a pending issue's machinery.
PENDING_VALUES: dict[tuple[str, str, str], int] = {}

# Config sections (and feature gates) whose behaviour is pending.
PENDING_SECTIONS: dict[str, int] = {}
PENDING_FEATURE_GATES: dict[str, int] = {}
KNOWN_FEATURE_GATES = frozenset({"dataLayer", "enableLegacyMetrics", "flowControl"})

_TEST_ONLY = (
    "a test-only plugin of llm-d's own loader and integration tests (not in llm-d's binary)"
)

REFUSED: dict[str, str] = {
    **{
        t: _TEST_ONLY
        for t in (
            "test-one",
            "test-two",
            "test-picker",
            "test-profile-handler",
            "test-source",
            "test-extractor",
            "mock-metrics-source",
            "header-based-testing-filter",
            "destination-endpoint-served-verifier",
        )
    },
    "request-attribute-reporter": "CEL expressions over response usage are not supported "
    "(extproc does not process response bodies)",
    "agent-identity": "agent identity headers are not implemented",
    "p2p-source-producer": "peer-to-peer KV transfer sources are not implemented",
    "disaggregatedset-rollout-screener": "DisaggregatedSet rollouts are not implemented",
    "disaggregatedset-rollout-pod-extractor": "DisaggregatedSet rollouts are not implemented",
    "vllmgrpc-parser": "gRPC request bodies are not parsed by extproc",
    "multicluster-approx-prefix-cache-producer": "multi-cluster routing is not implemented",
    "multicluster-file-discovery": "multi-cluster routing is not implemented",
    "multicluster-kv-cache-utilization-scorer": "multi-cluster routing is not implemented",
    "multicluster-metrics-data-source": "multi-cluster routing is not implemented",
    "multicluster-metrics-extractor": "multi-cluster routing is not implemented",
    "multicluster-prefix-cache-scorer": "multi-cluster routing is not implemented",
    "multicluster-queue-scorer": "multi-cluster routing is not implemented",
    "multicluster-session-affinity-filter": "multi-cluster routing is not implemented",
}

# Parameters of implemented plugins (scheduling plugins and flow control's) that are accepted
# with llm-d's name but have no effect, and why. `check-config` prints these when a config
# sets them. Each pair is one llm-d's plugin really has (its parameter struct in
# llm-d/llm-d-router, pkg/epp/framework/plugins, at ebab687 of 2026-08-22; prefix-cache-scorer's
# `mode` is older llm-d's; GIE's plugins have no producer-name parameters) and extproc's plugin
# accepts: tests/scheduling/test_llmd_translate.py checks that against each Params, and
# tests/docs that the parameter tables call exactly these ignored.
_PREFIX_INDEX = "the prefix match comes from the one shared prefix index, not a named producer"
_INFLIGHT = "in-flight counts are the picker's own, not a named producer's"
_PRODUCERS: dict[str, tuple[str, ...]] = {
    # llm-d's producer-name parameters: which producer's data the plugin reads.
    "prefix-cache-scorer": ("prefixMatchInfoProducerName",),
    "prefix-cache-affinity-filter": ("prefixMatchInfoProducerName", "inFlightLoadProducerName"),
    "no-hit-lru-scorer": ("prefixMatchInfoProducerName", "prefixPluginType", "prefixPluginName"),
    "pd-profile-handler": ("prefixMatchInfoProducerName", "prefixPluginType", "prefixPluginName"),
    "predicted-latency-producer": ("prefixMatchInfoProducerName", "inFlightLoadProducerName"),
    "active-request-scorer": ("inFlightLoadProducerName",),
    "token-load-scorer": ("inFlightLoadProducerName",),
    "utilization-filter": ("inFlightLoadProducerName",),
    "concurrency-detector": ("inFlightLoadProducerName",),
}
IGNORED_PARAMS: dict[tuple[str, str], str] = {
    **{
        (t, p): _PREFIX_INDEX if p.startswith("prefix") else _INFLIGHT
        for t, params in _PRODUCERS.items()
        for p in params
    },
    # (The latency plugins' latencyPredictionInfoProducerName does name the producer read.)
    ("mm-embeddings-cache-scorer", "producerName"): "the scorer keeps its own LRU of the "
    "media sent to each endpoint; there is no separate producer",
    **{
        (t, "topologyProducerName"): "topology is read from endpoint labels (the label keys "
        "of the config's topology-extractor)"
        for t in ("topology-affinity-filter", "topology-affinity-scorer")
    },
    **{
        (t, "producer"): "attributes are read by name; each has one producer in extproc "
        "(GPUUtilization: the DCGM poller)"
        for t in ("endpoint-attribute-filter", "endpoint-attribute-scorer")
    },
    ("pd-profile-handler", "primaryPort"): "deprecated in llm-d (not needed with Istio >= "
    "1.28.1); the request goes to the decode endpoint's own port",
    **{
        (t, "profileName"): "the token always names the primary pick"
        for t in ("session-affinity-scorer", "session-affinity-filter")
    },
    **{
        (t, "sessionIdConfig"): "only the session_id strategy reads it, and extproc "
        "implements encoded_endpoint_header only"
        for t in ("session-affinity-scorer", "session-affinity-filter")
    },
    **{
        ("active-request-scorer", p): "extproc scores in-flight counts min-max over the "
        "candidates; requests leave the count when their stream ends"
        for p in ("idleThreshold", "maxBusyScore")
    },
    ("active-request-scorer", "requestTimeout"): "in-flight requests end when the stream ends",
    ("token-load-scorer", "queueThresholdTokens"): "extproc scores in-flight tokens min-max "
    "over the candidates",
    **{
        (t, "maxNumOfEndpoints"): "a decision carries the pick plus server.fallbacks endpoints"
        for t in ("max-score-picker", "random-picker", "weighted-random-picker")
    },
    ("prefix-cache-scorer", "mode"): "the keys are precise when the config sets up precise "
    "prefix matching (parse.precise, or llm-d's precise producer), else approximate",
    **{
        ("predicted-latency-producer", p): "deprecated and unused in llm-d too (its "
        "mid-stream TPOT sampling was removed)"
        for p in ("samplingMean", "maxDecodeTokenSamplesForPrediction")
    },
    ("predicted-latency-producer", "contextTTL"): "extproc keeps no per-request context to "
    "expire: predictions last while the request is scheduled, learning reads the servers' "
    "histograms",
    **{
        ("predicted-latency-producer", p): "extproc's latency model has no encoder-cache features"
        for p in ("useEncoderCacheFeatures", "encoderCacheMatchInfoProducerName")
    },
    **{
        (t, "headroom"): "it sets llm-d's per-endpoint routing limit, a filter extproc lacks"
        for t in ("utilization-detector", "concurrency-detector")
    },
}

# Every plugin type llm-d's router registers (llm-d/llm-d-router, pkg/epp and pkg/plugins),
# for "did you mean" and to tell "an llm-d type extproc refuses" from a typo.
LLMD_TYPES: frozenset[str] = frozenset(
    {
        *PENDING_TYPES,
        *REFUSED,
        "active-request-scorer",
        "always-disagg-multimodal-decider",
        "always-disagg-pd-decider",
        "anthropic-parser",
        "approx-prefix-cache-producer",
        "burst-prefix-cache-producer",
        "by-label",
        "by-label-selector",
        "context-length-aware",
        "core-metrics-extractor",
        "cross-replica-publisher",
        "data-parallel-profile-handler",
        "decode-filter",
        "disagg-headers-handler",
        "disagg-profile-handler",
        "encode-filter",
        "dcgm-data-source",
        "dcgm-extractor",
        "endpoint-attribute-filter",
        "endpoint-attribute-scorer",
        "endpoint-notification-source",
        "file-discovery",
        "header-label-affinity-scorer",
        "header-profile-handler",
        "inflight-load-producer",
        "k8s-notification-source",
        "kv-cache-utilization-scorer",
        "label-selector-filter",
        "load-aware-scorer",
        "local-syncer",
        "lora-affinity-scorer",
        "max-score-picker",
        "metrics-data-source",
        "mm-embeddings-cache-producer",
        "mm-embeddings-cache-scorer",
        "models-data-extractor",
        "models-data-source",
        "no-hit-lru-scorer",
        "openai-parser",
        "passthrough-parser",
        "pd-profile-handler",
        "precise-prefix-cache-producer",
        "precise-prefix-cache-scorer",
        "prefill-filter",
        "prefill-header-handler",
        "prefix-based-pd-decider",
        "prefix-cache-affinity-filter",
        "prefix-cache-scorer",
        "queue-scorer",
        "random-picker",
        "running-requests-size-scorer",
        "session-affinity-filter",
        "session-affinity-scorer",
        "session-id-producer",
        "sglanghttp-parser",
        "single-profile-handler",
        "token-load-scorer",
        "token-producer",
        "tokenizer",
        "topology-affinity-filter",
        "topology-affinity-scorer",
        "topology-extractor",
        "utilization-filter",
        "vertexai-parser",
        "vllmhttp-parser",
        "weighted-random-picker",
        # predicted latency (registered scheduling plugins)
        "latency-scorer",
        "latency-slo-admitter",
        "predicted-latency-producer",
        "slo-headroom-tier-filter",
        # flow control (built by extproc.flowcontrol, not the scheduling registry)
        "concurrency-detector",
        "eviction-priority-then-time-ordering",  # GIE v1.5's name
        "eviction-sheddable-filter",  # GIE v1.5's name
        "priority-then-time-eviction-order-policy",
        "sheddable-eviction-filter",
        "edf-ordering-policy",
        "fcfs-ordering-policy",
        "global-strict-fairness-policy",
        "priority-holdback-policy",
        "probabilistic-admitter",
        "round-robin-fairness-policy",
        "slo-deadline-ordering-policy",
        "static-usage-limit-policy",
        "utilization-detector",
        # GIE v0.5's chart defaults
        "decision-tree-filter",
        "kv-cache-scorer",
        "least-kv-cache-filter",
        "least-queue-filter",
        "low-queue-filter",
        "lora-affinity-filter",
    }
)
