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

# Parameters of implemented plugins that are accepted with llm-d's name but have no effect,
# and why. `check-config` prints these when a config sets them.
IGNORED_PARAMS: dict[tuple[str, str], str] = {
    **{
        (t, p): "extproc plugins read the shared prefix index / in-flight counts directly, "
        "there is one producer of each"
        for t in (
            "prefix-cache-scorer",
            "prefix-cache-affinity-filter",
            "no-hit-lru-scorer",
            "active-request-scorer",
            "token-load-scorer",
            "utilization-filter",
            "mm-embeddings-cache-scorer",
            "topology-affinity-filter",
            "topology-affinity-scorer",
        )
        for p in (
            "prefixMatchInfoProducerName",
            "inFlightLoadProducerName",
            "latencyPredictionInfoProducerName",
            "producerName",
            "topologyProducerName",
        )
    },
    **{
        ("pd-profile-handler", p): "the prefix match comes from the shared index"
        for p in ("prefixPluginType", "prefixPluginName", "prefixMatchInfoProducerName")
    },
    ("pd-profile-handler", "primaryPort"): "deprecated in llm-d (not needed with Istio >= "
    "1.28.1); the request goes to the decode endpoint's own port",
    ("session-affinity-scorer", "profileName"): "the token always names the primary pick",
    ("session-affinity-filter", "profileName"): "the token always names the primary pick",
    **{
        ("active-request-scorer", p): "extproc scores in-flight counts min-max over the "
        "candidates; requests leave the count when their stream ends"
        for p in ("idleThreshold", "maxBusyScore")
    },
    ("token-load-scorer", "queueThresholdTokens"): "extproc scores in-flight tokens min-max "
    "over the candidates",
    **{
        (t, "maxNumOfEndpoints"): "a decision carries the pick plus server.fallbacks endpoints"
        for t in ("max-score-picker", "random-picker", "weighted-random-picker")
    },
    **{
        (t, "producer"): "attributes are read by name; each has one producer in extproc "
        "(GPUUtilization: the DCGM poller)"
        for t in ("endpoint-attribute-filter", "endpoint-attribute-scorer")
    },
    ("no-hit-lru-scorer", "prefixPluginType"): "the prefix match comes from the shared index",
    ("no-hit-lru-scorer", "prefixPluginName"): "the prefix match comes from the shared index",
    ("prefix-cache-scorer", "autoTune"): "block size comes from blockSizeTokens or the engine",
    ("prefix-cache-scorer", "mode"): "the keys are precise when the config sets up precise "
    "prefix matching (parse.precise, or llm-d's precise producer), else approximate",
    ("active-request-scorer", "requestTimeout"): "in-flight requests end when the stream ends",
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
