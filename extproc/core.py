"""The shapes every layer speaks: read this module first.

A request flows  server -> requests (body -> InferenceRequest) -> hashing (block keys)
-> index (prefix matches) -> scheduling (Candidates -> Decision) -> server (answer).
These types are the hand-offs between those stages; nothing here does I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

import msgspec

_EMPTY: Mapping[str, str] = MappingProxyType({})
_EMPTY_FLOATS: Mapping[str, float] = MappingProxyType({})


def _empty() -> Mapping[str, str]:
    return _EMPTY


class Api(enum.Enum):
    """Which API a request body speaks (decided from the path)."""

    COMPLETIONS = "completions"
    CHAT = "chat"
    RESPONSES = "responses"
    EMBEDDINGS = "embeddings"
    MESSAGES = "messages"  # Anthropic
    UNKNOWN = "unknown"


class Modality(enum.Enum):
    TEXT = "text"
    IMAGE = "image"
    AUDIO = "audio"
    VIDEO = "video"


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One image/audio/video item of a request, identified by its content.

    `content_hash` is blake3 hex of the decoded bytes for inline media, or of the normalized
    URL for remote media (never fetched). `tokens` is the estimated token cost.
    """

    modality: Modality
    content_hash: str
    tokens: int
    is_remote: bool = False
    width: int | None = None
    height: int | None = None


class Part(msgspec.Struct, frozen=True, gc=False):
    """One piece of a message, in reading order: text, or a media item (then `text` is "").

    Part and Message are msgspec Structs, not dataclasses: a long conversation builds
    hundreds of them per request, and a frozen dataclass costs ~1 µs each to build (a
    Struct ~0.1 µs). Untracked by the cycle collector (`gc=False`): they hold only strings,
    bytes, tuples and media items, never themselves."""

    text: str = ""
    media: MediaItem | None = None


class Message(msgspec.Struct, frozen=True, gc=False):
    """One conversation turn, whatever API it came from (Anthropic and Responses inputs are
    mapped onto chat roles). `tool_calls` holds the raw JSON text of each call the assistant
    made; `tool_call_id` is set on tool results."""

    role: str
    parts: tuple[Part, ...] = ()
    name: str | None = None
    tool_calls: tuple[bytes, ...] = ()
    tool_call_id: str | None = None


@dataclass(frozen=True, slots=True)
class Prompt:
    """The prompt content in the order the model reads it: tool definitions (raw JSON text,
    as sent), then either chat `messages` or a `completion` (text or token ids; for a batch,
    the first prompt).

    The request options that change the engine's token ids (vLLM's names):
    `add_special_tokens` (None: the API's default, BOS on completions, none on chat),
    `add_generation_prompt` (None: the configured default) and `continue_final_message`
    (the last assistant turn is left open: the template's closing text is cut off)."""

    tools: tuple[bytes, ...] = ()
    messages: tuple[Message, ...] = ()
    completion: str | tuple[int, ...] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """What routing needs to know about one request, parsed once from headers and body.

        `headers` holds the request headers with lower-case names (the picker's own routing
        headers already removed). `block_keys` is the chained prefix-block hash sequence, each key
    covering about `block_tokens` tokens;
        `prompt_tokens` an estimate of the prompt's token cost (text and media). `media` lists
        each distinct asset once (by content hash), in order of first appearance. `prompt` is
        the parsed content (None for unknown APIs), kept for precise (tokenizer) block keys.
    """

    request_id: str
    path: str
    api: Api = Api.UNKNOWN
    model: str = ""
    headers: Mapping[str, str] = field(default_factory=_empty)
    body_bytes: int = 0
    stream: bool = False
    prompt_tokens: int = 0
    block_keys: tuple[int, ...] = ()
    block_tokens: int = 0
    media: tuple[MediaItem, ...] = ()
    lora_adapter: str | None = None
    cache_salt: str | None = None
    # The client's output cap (max_tokens / max_completion_tokens / max_output_tokens), None
    # when the body sets none: an upper bound on the KV the request's output can take.
    max_output_tokens: int | None = None
    # Whether the body sets vLLM's top-level `priority` (flow control's `engine_priority`
    # replaces it rather than inserting a second one).
    client_priority: bool = False
    prompt: Prompt | None = field(default=None, repr=False, compare=False)
    # The endpoint an earlier profile of the same request chose (the decode pick, while the
    # prefill profile runs): topology plugins place a stage near its peer.
    peer: Endpoint | None = field(default=None, repr=False, compare=False)

    @property
    def has_media(self) -> bool:
        return bool(self.media)


def common_prefix_blocks(
    keys: Sequence[int], other: Sequence[int], limit: int | None = None
) -> int:
    """Leading blocks two `block_keys` sequences share, up to `limit`. The keys are chained
    (each covers its prefix), so two sequences agree up to some block and differ from there
    on, and a bisection finds it."""
    lo, hi = 0, min(len(keys), len(other))
    if limit is not None:
        hi = min(hi, limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if keys[mid - 1] == other[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A model-server endpoint: `address` is `ip:port`, exactly what Envoy is told."""

    address: str
    name: str = ""
    labels: Mapping[str, str] = field(default_factory=_empty, hash=False, compare=False)

    @property
    def role(self) -> str:
        """The `llm-d.ai/role` label, or "" when unlabeled."""
        return self.labels.get("llm-d.ai/role", "")


@dataclass(frozen=True, slots=True)
class EndpointState:
    """Live load figures for one endpoint.

    `kv_usage` is a 0..1 fraction. `age_s` is seconds since the figures were scraped
    (`None` means never scraped); `is_stale` says they are too old to trust (or missing), by
    the configured threshold. In-flight counts are those placed by pickers (all picker
    processes, when state is shared) and not yet finished; `inflight_tokens` counts their
    prefill work: prompt tokens the endpoint did not already hold when the request was
    placed. `kv_block_size` / `kv_blocks` are the engine's cache config (tokens per block,
    GPU blocks); adapters are LoRA names. `prefill_tps` is the endpoint's prefill speed in
    tokens per second as the picker has measured it (None until learned). `prefilling` is
    the engine's requests not yet past their first token (waiting, or running their
    prefill), from its first-token and finished counts (endpoints/state.py); None when the
    engine does not export them.
    """

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    inflight_requests: int = 0
    inflight_tokens: int = 0
    age_s: float | None = None
    is_stale: bool = True
    kv_block_size: int | None = None
    kv_blocks: int | None = None
    max_adapters: int | None = None
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    # Named figures from other sources than the engine's metrics (e.g. `GPUUtilization`
    # 0..1 from DCGM), read by llm-d's endpoint-attribute plugins; absent when unknown.
    attributes: Mapping[str, float] = field(default_factory=lambda: _EMPTY_FLOATS)
    prefill_tps: float | None = None
    prefilling: int | None = None

    def with_prefill_tps(self, tps: float | None) -> EndpointState:
        """This state with `prefill_tps` set. Spelled out, not `dataclasses.replace`: it runs
        per candidate per request, and replace() looks every field up by name each call
        (about twice the cost). tests/server/test_candidate_state.py checks it keeps every
        field."""
        return EndpointState(
            self.waiting,
            self.running,
            self.kv_usage,
            self.inflight_requests,
            self.inflight_tokens,
            self.age_s,
            self.is_stale,
            self.kv_block_size,
            self.kv_blocks,
            self.max_adapters,
            self.running_adapters,
            self.waiting_adapters,
            self.attributes,
            tps,
            self.prefilling,
        )


@dataclass(frozen=True, slots=True)
class Candidate:
    """An endpoint as the scheduler sees it: identity, live state, and its prefix match.

    `prefix_blocks` is the tier-weighted number of leading request blocks this endpoint is
    believed to hold (0 when unknown). `prefix_known` is False when the index could not
    answer (a degraded lookup): the 0 then says nothing of what is cached.
    """

    endpoint: Endpoint
    state: EndpointState = EndpointState()
    prefix_blocks: float = 0.0
    prefix_known: bool = True


@dataclass(frozen=True, slots=True)
class Decision:
    """The scheduler's answer.

    `endpoints` is ordered: the first is the pick, the rest are fallbacks. `headers` are
    extra request headers to set on the forwarded request (disaggregation hints);
    `response_headers` go back to the client (a session token). `prefill` / `encoders` are the
    endpoints chosen for disaggregated prefill and encode, when any. `scores` and `reasons`
    explain the choice (only filled when an explanation was asked for): per-plugin scores by
    endpoint address, and which filter removed whom.
    """

    endpoints: tuple[Endpoint, ...]
    headers: Mapping[str, str] = field(default_factory=_empty)
    response_headers: Mapping[str, str] = field(default_factory=_empty)
    prefill: Endpoint | None = None
    encoders: tuple[Endpoint, ...] = ()
    scores: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    reasons: tuple[str, ...] = ()
    profile: str = "default"
    # Per explaining scorer, per address, what its score was made of (explained only).
    terms: Mapping[str, Mapping[str, Mapping[str, float]]] = field(default_factory=dict)

    @property
    def primary(self) -> Endpoint:
        return self.endpoints[0]


@dataclass(frozen=True, slots=True)
class LatencyTotals:
    """Cumulative sums and counts of vLLM's latency histograms (seconds), as exported since
    the engine started; the latency model learns from their differences between scrapes.

    `prefill_tokens` is the uncached prompt tokens prefilled (vLLM's
    `request_prefill_kv_computed_tokens` sum, else `prompt_tokens_by_source{local_compute}`),
    None when neither is exported. `prompt` is `request_prompt_tokens` (tokens per request,
    as the engine's tokenizer counts them). `decode` is `request_decode_time_seconds` (first
    token to last; vLLM observes it, and the prefill time, when the request finishes). A
    histogram not exported has count 0.
    """

    ttft_sum: float = 0.0
    ttft_count: float = 0.0
    queue_sum: float = 0.0
    queue_count: float = 0.0
    prefill_sum: float = 0.0
    prefill_count: float = 0.0
    itl_sum: float = 0.0
    itl_count: float = 0.0
    tpot_sum: float = 0.0
    tpot_count: float = 0.0
    prompt_sum: float = 0.0
    prompt_count: float = 0.0
    decode_sum: float = 0.0
    decode_count: float = 0.0
    prefill_tokens: float | None = None
