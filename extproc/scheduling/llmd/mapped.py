"""llm-d plugin types that are data plumbing extproc does itself: which built-in machinery
each one turns on (`Plumbing`), with llm-d's parameters decoded strictly and the ones that
have no effect in extproc named with the reason.

`Plumbing` is a neutral record of settings changes; `extproc.config` applies it to the
Settings tree (this package does not import the settings modules).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec


@dataclass(frozen=True, slots=True)
class Plumbing:
    """Settings an llm-d config implies. None: leave extproc's setting as it is."""

    index_mode: Literal["approximate", "precise"] | None = None
    block_tokens: int | None = None
    block_chars: int | None = None
    max_prefix_blocks: int | None = None
    max_prefix_tokens: int | None = None
    capacity_blocks: int | None = None
    precise_model: str | None = None
    precise_block_size: int | None = None
    kv_events_bind: str | None = None
    scrape_scheme: Literal["http", "https"] | None = None
    scrape_path: str | None = None
    scrape_interval_s: float | None = None
    endpoints_file: str | None = None
    topology_labels: tuple[tuple[str, str], ...] | None = None
    dcgm: bool | None = None
    dcgm_scheme: Literal["http", "https"] | None = None
    dcgm_path: str | None = None
    dcgm_port: int | None = None
    dcgm_interval_s: float | None = None
    # llm-d's insecureSkipVerify, inverted (None: not set, the unverified default stays).
    scrape_tls_verify: bool | None = None
    scrape_tls_ca_file: str | None = None
    dcgm_tls_verify: bool | None = None
    # dataLayer.crossReplicaSyncInterval: how often replicas exchange in-flight counts.
    shared_inflight_interval_s: float | None = None

    def merge(self, other: Plumbing) -> Plumbing:
        """`other`'s set fields over ours; precise beats approximate (a precise producer and
        an approximate scorer in one config mean the precise index feeds the scorer)."""
        changes = {
            f.name: getattr(other, f.name)
            for f in dataclasses.fields(other)
            if getattr(other, f.name) is not None
        }
        if self.index_mode == "precise" and changes.get("index_mode") == "approximate":
            del changes["index_mode"]
        return dataclasses.replace(self, **changes)


class _P(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class NoParams(_P, frozen=True):
    pass


Effect = Callable[[Any], tuple[Plumbing, list[str]]]


@dataclass(frozen=True, slots=True)
class MappedType:
    """`how`: the machinery it turns on, for check-config. `ignored`: parameter (as llm-d
    spells it, a field of `params`) -> why it has no effect in extproc; noted when set
    (`llmd.ignored`). `effect`: the settings the decoded params imply, and notes the
    `ignored` table cannot say. `scheduling_type`: when the llm-d type is also a scheduling
    plugin (precise-prefix-cache-scorer), the extproc type that stands in for it in profiles."""

    how: str
    params: type[msgspec.Struct] = NoParams
    effect: Effect | None = None
    scheduling_type: str | None = None
    ignored: Mapping[str, str] = field(default_factory=dict)


# -- request parsers --------------------------------------------------------------------

_PARSER = (
    "the built-in request parser (OpenAI chat, completions, responses, embeddings; "
    "Anthropic messages)"
)


def _other_api(_: Any) -> tuple[Plumbing, list[str]]:
    return Plumbing(), [
        "bodies in this API's own shape are not parsed: such requests are routed by load, "
        "without prefix keys"
    ]


# -- endpoint metrics -------------------------------------------------------------------


class MetricsSourceParams(_P, frozen=True):
    scheme: Literal["http", "https"] | None = None
    path: str | None = None
    port: int | None = None
    insecureSkipVerify: bool | None = None
    caCertPath: str | None = None
    clientCertPath: str | None = None
    clientKeyPath: str | None = None
    interval: str | None = None


def parse_duration_s(text: str) -> float:
    """A Go duration ('50ms', '1s', '1m30s') in seconds."""
    import re

    units = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r} (e.g. '50ms', '1s')")
    return sum(float(n) * units[u] for n, u in parts)


def _metrics_source(p: MetricsSourceParams) -> tuple[Plumbing, list[str]]:
    interval = parse_duration_s(p.interval) if p.interval else None
    return (
        Plumbing(
            scrape_scheme=p.scheme,
            scrape_path=p.path,
            scrape_interval_s=interval,
            scrape_tls_verify=_verify(p.insecureSkipVerify),
            scrape_tls_ca_file=p.caCertPath,
        ),
        [],
    )


_METRICS_SOURCE_IGNORED = {
    "port": "metrics are scraped on each endpoint's serving port",
    "clientCertPath": "scrapes present no client certificate",
    "clientKeyPath": "scrapes present no client certificate",
}


def _verify(insecure_skip_verify: bool | None) -> bool | None:
    return None if insecure_skip_verify is None else not insecure_skip_verify


class MetricsExtractorParams(_P, frozen=True):
    engineLabelKey: str | None = None
    engineConfigs: list[dict[str, Any]] | None = None
    customMetrics: list[dict[str, Any]] | None = None


_VLLM_NAMES = "extproc reads vLLM's metric names (queue, running, KV usage, LoRA, cache config)"


# -- discovery --------------------------------------------------------------------------


class K8sSourceParams(_P, frozen=True):
    group: str | None = None
    version: str | None = None
    kind: str | None = None


# llm-d watches any resource kind named here; extproc's discovery watches one thing.
_ONE_KIND = (
    "extproc's discovery watches the InferencePool's endpoints (--inference-pool), no other kind"
)


class FileDiscoveryParams(_P, frozen=True):
    path: str | None = None
    watchFile: bool | None = None


def _file_discovery(p: FileDiscoveryParams) -> tuple[Plumbing, list[str]]:
    notes = [] if p.watchFile is not False else ["watchFile: false ignored: the file is watched"]
    return Plumbing(endpoints_file=p.path), notes


# -- prefix-cache producers ---------------------------------------------------------------


class ApproxProducerParams(_P, frozen=True):
    autoTune: bool | None = None
    blockSizeTokens: int | None = None
    blockSize: int | None = None
    maxPrefixBlocksToMatch: int | None = None
    maxPrefixTokensToMatch: int | None = None
    lruCapacityPerServer: int | None = None
    # GIE's prefix-cache-scorer (v0.5-v1.x): the block size in prompt characters.
    hashBlockSize: int | None = None


def approx(p: ApproxProducerParams) -> tuple[Plumbing, list[str]]:
    """Approximate-index settings from llm-d's approximate producer parameters (also for the
    older prefix-cache-scorer, which took them itself; APPROX_IGNORED serves both)."""
    plumbing = Plumbing(
        index_mode="approximate",
        block_tokens=p.blockSizeTokens or p.blockSize,
        block_chars=p.hashBlockSize,
        max_prefix_blocks=p.maxPrefixBlocksToMatch,
        max_prefix_tokens=p.maxPrefixTokensToMatch,
        capacity_blocks=p.lruCapacityPerServer,
    )
    return plumbing, []


APPROX_IGNORED = {
    "autoTune": "the block size comes from blockSizeTokens (extproc does not read it from "
    "the engine)"
}


class BurstProducerParams(_P, frozen=True):
    windowDurationMs: int | None = None
    maxPerReplica: int | None = None
    blockSizeTokens: int | None = None
    maxPrefixTokensToMatch: int | None = None
    minColocateBlocks: int | None = None
    maxBatchSize: int | None = None
    balanceBy: str | None = None


def _burst(p: BurstProducerParams) -> tuple[Plumbing, list[str]]:
    plumbing = Plumbing(
        index_mode="approximate",
        block_tokens=p.blockSizeTokens,
        max_prefix_tokens=p.maxPrefixTokensToMatch,
    )
    return plumbing, []


_NO_BURST = "burst batching is not implemented: each request is scored on its own"


class TokenProcessorParams(_P, frozen=True):
    blockSize: int | None = None
    blockSizeTokens: int | None = None
    hashSeed: str | int | None = None


class PreciseProducerParams(_P, frozen=True):
    tokenProcessorConfig: TokenProcessorParams | None = None
    indexerConfig: dict[str, Any] | None = None
    kvEventsConfig: dict[str, Any] | None = None
    speculativeIndexing: bool | None = None
    speculativeTTL: str | None = None


def _precise(p: PreciseProducerParams) -> tuple[Plumbing, list[str]]:
    tp = p.tokenProcessorConfig
    nested = (p.indexerConfig or {}).get("tokenProcessorConfig") or {}
    block = (tp.blockSize or tp.blockSizeTokens if tp else None) or nested.get("blockSize")
    notes = []
    if (tp and tp.hashSeed is not None) or "hashSeed" in nested:
        notes.append(
            "parameter hashSeed ignored: extproc recomputes block keys from the token ids in "
            "each KV event, so the engine's hash seed does not matter"
        )
    if p.speculativeIndexing or p.speculativeTTL is not None:
        # speculativeTTL only tunes speculative indexing: said the same way, never silently.
        notes.append(
            "speculativeIndexing / speculativeTTL: extproc records each decision in the "
            "index only in approximate mode; in precise mode the KV events are the truth"
        )
    events = p.kvEventsConfig or {}
    bind = events.get("zmqEndpoint")
    extra = sorted(set(events) - {"zmqEndpoint"})
    if extra:
        notes.append(f"kvEventsConfig {', '.join(extra)} ignored: extproc's own subscriber")
    plumbing = Plumbing(
        index_mode="precise",
        precise_block_size=int(block) if block else None,
        kv_events_bind=str(bind) if bind else None,
    )
    return plumbing, notes


_PRECISE_IGNORED = {
    "indexerConfig": "the index is configured in extproc's `index` settings (memory or Redis)"
}


class TokenProducerParams(_P, frozen=True):
    modelName: str | None = None
    vllm: dict[str, Any] | None = None
    udsTokenizerConfig: dict[str, Any] | None = None
    estimate: dict[str, Any] | None = None


def _tokenizer(p: TokenProducerParams) -> tuple[Plumbing, list[str]]:
    return Plumbing(precise_model=p.modelName), []


_IN_PROCESS = "extproc tokenizes in-process with a local tokenizer.json, never calls a service"
_TOKENIZER_IGNORED = {
    "vllm": _IN_PROCESS,
    "udsTokenizerConfig": _IN_PROCESS,
    "estimate": "extproc's own token estimates (parse settings) are used",
}


class InflightProducerParams(_P, frozen=True):
    addEstimatedOutputTokens: bool | None = None
    outputRatio: float | None = None
    maxEstimatedOutputTokens: int | None = None
    prefixMatchInfoProducerName: str | None = None
    syncCrossReplicaState: bool | None = None


_NO_OUTPUT_ESTIMATE = (
    "in-flight tokens count the uncached prompt tokens placed, not estimated output"
)


class MMProducerParams(_P, frozen=True):
    cacheSizeInMBPerServer: int | None = None
    cacheSizeInMB: int | None = None


_MEDIA_ITEMS = "the encoder-cache LRU counts media items (mm-embeddings-cache-scorer `capacity`)"


class TopologyExtractorParams(_P, frozen=True):
    hostname: str = "kubernetes.io/hostname"
    rack: str = "topology.kubernetes.io/rack"
    zone: str = "topology.kubernetes.io/zone"
    region: str = "topology.kubernetes.io/region"


def _topology(p: TopologyExtractorParams) -> tuple[Plumbing, list[str]]:
    levels = (("hostname", p.hostname), ("rack", p.rack), ("zone", p.zone), ("region", p.region))
    return Plumbing(topology_labels=levels), []


class DCGMSourceParams(_P, frozen=True):
    scheme: Literal["http", "https"] | None = None
    path: str | None = None
    port: int | None = None
    insecureSkipVerify: bool | None = None
    useNodeAddress: bool | None = None
    interval: str | None = None


def _dcgm(p: DCGMSourceParams) -> tuple[Plumbing, list[str]]:
    interval = parse_duration_s(p.interval) if p.interval else None
    plumbing = Plumbing(
        dcgm=True,
        dcgm_scheme=p.scheme,
        dcgm_path=p.path,
        dcgm_port=p.port,
        dcgm_interval_s=interval,
        dcgm_tls_verify=_verify(p.insecureSkipVerify),
    )
    return plumbing, []


class SessionIDParams(_P, frozen=True):
    headerName: str | None = None
    cookieName: str | None = None


# llm-d's producer feeds the session-affinity plugins' session_id strategy, which extproc
# refuses; its encoded_endpoint_header strategy reads its own token header.
_NO_SESSION_ID = (
    "nothing reads the session ID: session affinity uses the encoded endpoint token "
    "(encodedEndpointHeaderConfig.header), not llm-d's session_id strategy"
)


MAPPED: dict[str, MappedType] = {
    "openai-parser": MappedType(_PARSER),
    "anthropic-parser": MappedType(_PARSER),
    "vllmhttp-parser": MappedType(_PARSER),
    "passthrough-parser": MappedType(_PARSER),
    "vertexai-parser": MappedType(_PARSER, effect=_other_api),
    "sglanghttp-parser": MappedType(_PARSER, effect=_other_api),
    "metrics-data-source": MappedType(
        "the endpoint metrics scraper (state.scrape)",
        MetricsSourceParams,
        _metrics_source,
        ignored=_METRICS_SOURCE_IGNORED,
    ),
    "core-metrics-extractor": MappedType(
        "the scraper's metric parsing (vLLM names)",
        MetricsExtractorParams,
        ignored=dict.fromkeys(("engineLabelKey", "engineConfigs", "customMetrics"), _VLLM_NAMES),
    ),
    "endpoint-notification-source": MappedType(
        "endpoint discovery (--inference-pool watch, --endpoints, --endpoints-file)"
    ),
    "k8s-notification-source": MappedType(
        "endpoint discovery (--inference-pool watch)",
        K8sSourceParams,
        ignored=dict.fromkeys(("group", "version", "kind"), _ONE_KIND),
    ),
    "file-discovery": MappedType(
        "endpoint discovery from a file (discovery.endpoints_file)",
        FileDiscoveryParams,
        _file_discovery,
    ),
    "models-data-source": MappedType(
        "no effect: extproc does not restrict endpoints by their served-model list"
    ),
    "models-data-extractor": MappedType(
        "no effect: extproc does not restrict endpoints by their served-model list"
    ),
    "approx-prefix-cache-producer": MappedType(
        "the KV-block index in approximate mode (decisions recorded)",
        ApproxProducerParams,
        approx,
        ignored=APPROX_IGNORED,
    ),
    "burst-prefix-cache-producer": MappedType(
        "the KV-block index in approximate mode (decisions recorded)",
        BurstProducerParams,
        _burst,
        ignored=dict.fromkeys(
            ("windowDurationMs", "maxPerReplica", "minColocateBlocks", "maxBatchSize", "balanceBy"),
            _NO_BURST,
        ),
    ),
    "precise-prefix-cache-producer": MappedType(
        "the KV-block index in precise mode (vLLM KV events + local tokenizer)",
        PreciseProducerParams,
        _precise,
        ignored=_PRECISE_IGNORED,
    ),
    "precise-prefix-cache-scorer": MappedType(
        "prefix-cache-scorer over the KV-block index in precise mode (vLLM KV events + "
        "local tokenizer)",
        PreciseProducerParams,
        _precise,
        scheduling_type="prefix-cache-scorer",
        ignored=_PRECISE_IGNORED,
    ),
    "token-producer": MappedType(
        "the precise tokenizer, found by model name in a local directory or cache",
        TokenProducerParams,
        _tokenizer,
        ignored=_TOKENIZER_IGNORED,
    ),
    "tokenizer": MappedType(
        "the precise tokenizer, found by model name in a local directory or cache",
        TokenProducerParams,
        _tokenizer,
        ignored=_TOKENIZER_IGNORED,
    ),
    "inflight-load-producer": MappedType(
        "the picker's own in-flight counts (requests and uncached prompt tokens placed)",
        InflightProducerParams,
        ignored={
            **dict.fromkeys(
                ("addEstimatedOutputTokens", "outputRatio", "maxEstimatedOutputTokens"),
                _NO_OUTPUT_ESTIMATE,
            ),
            "syncCrossReplicaState": "in-flight counts are shared through Redis when the "
            "index is in Redis (state.shared_inflight)",
            "prefixMatchInfoProducerName": "the uncached prompt tokens come from the one "
            "shared prefix index, not a named producer",
        },
    ),
    "session-id-producer": MappedType(
        "no effect: session-affinity plugins read their token header themselves",
        SessionIDParams,
        ignored=dict.fromkeys(("headerName", "cookieName"), _NO_SESSION_ID),
    ),
    "mm-embeddings-cache-producer": MappedType(
        "the mm-embeddings-cache-scorer's LRU of media sent to each endpoint",
        MMProducerParams,
        ignored=dict.fromkeys(("cacheSizeInMBPerServer", "cacheSizeInMB"), _MEDIA_ITEMS),
    ),
    "topology-extractor": MappedType(
        "topology read from endpoint labels (hostname, rack, zone, region)",
        TopologyExtractorParams,
        _topology,
    ),
    "dcgm-data-source": MappedType(
        "the DCGM exporter poller (state.dcgm): each endpoint's host at `port`",
        DCGMSourceParams,
        _dcgm,
        ignored={"useNodeAddress": "the exporter is polled at each endpoint's own host address"},
    ),
    "dcgm-extractor": MappedType(
        "the GPUUtilization attribute: the endpoint pod's highest DCGM_FI_DEV_GPU_UTIL / 100",
        effect=lambda _: (Plumbing(dcgm=True), []),
    ),
    "prefill-header-handler": MappedType(
        "the disaggregation headers disagg-profile-handler sets itself"
    ),
    "disagg-headers-handler": MappedType(
        "the disaggregation headers disagg-profile-handler sets itself"
    ),
    "cross-replica-publisher": MappedType(
        "in-flight counts shared through Redis (state.shared_inflight)"
    ),
    "local-syncer": MappedType("in-flight counts shared through Redis (state.shared_inflight)"),
}
