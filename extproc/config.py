"""Settings: one frozen tree, decoded from YAML with unknown fields rejected.

A config file is either our own document (`server`, `parse`, `index`, `state`,
`scheduling`, ...) or a bare llm-d `EndpointPickerConfig`, which is taken as the
`scheduling` section. `cli.py` folds flags into these structs; nothing below it reads the
environment. Errors name the field and its line: `picker.yaml:14: scheduling.plugins[2].type:
unknown plugin type 'x'`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
import yaml

from extproc.endpoints.dcgm import DCGMSettings
from extproc.endpoints.request_end import RequestEndSettings
from extproc.endpoints.scrape import ScrapeSettings
from extproc.endpoints.shared_inflight import SharedInFlightSettings
from extproc.errors import ConfigError, format_path
from extproc.flowcontrol.config import (
    ADMITTER_TYPES,
    FLOW_PLUGIN_TYPES,
    FlowConfig,
    FlowControlSettings,
    build_flow_config,
)
from extproc.hashing.tokenizer import PreciseSettings
from extproc.index.base import DEFAULT_TIER_WEIGHTS, IndexOptions
from extproc.index.redis import DEFAULT_LOOKUP_BUDGET_MAX_S, DEFAULT_LOOKUP_BUDGET_S
from extproc.requests import ParseSettings
from extproc.scheduling.config import EndpointPickerConfig, build_scheduler, default_config
from extproc.scheduling.framework import Scheduler
from extproc.scheduling.llmd.mapped import Plumbing
from extproc.scheduling.llmd.translate import Translation, translate
from extproc.scheduling.registry import PluginRegistry, validation_error

MiB = 1 << 20
_Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
_PositiveS = Annotated[float, msgspec.Meta(gt=0)]
# The index's own defaults, so a setting left out means what the library means.
_INDEX_DEFAULTS = IndexOptions()
# Per endpoint: the served index stays bounded (IndexOptions alone means unbounded, for
# library users who size their own). 500k blocks of 16 tokens is 8M tokens of cache.
DEFAULT_CAPACITY_BLOCKS = 500_000


class TLSSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """TLS on the ext_proc port: PEM `cert_file` + `key_file`, or `self_signed: true` for a
    key and certificate generated at start (for a proxy that encrypts without verifying, e.g.
    Envoy with `extproc envoy-config --extproc-tls`). The health port stays plaintext:
    kubelet's gRPC probes cannot speak TLS."""

    cert_file: str | None = None
    key_file: str | None = None
    self_signed: bool = False

    def __post_init__(self) -> None:
        has_files = self.cert_file is not None or self.key_file is not None
        if self.self_signed and has_files:
            raise ValueError("set either self_signed or cert_file + key_file, not both")
        if not self.self_signed and (self.cert_file is None or self.key_file is None):
            raise ValueError("needs cert_file and key_file (or self_signed: true)")


class ServerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ext_proc server.

    `max_body_bytes`: larger request bodies get 413 (checked against content-length first,
    then while streaming; never buffered past it). `fallbacks`: how many extra endpoints the
    destination list carries after the pick (override-host mode walks them on retry; leave 0
    for ORIGINAL_DST, which takes exactly one address). `drain_delay_s`: after SIGTERM, how
    long the picker keeps serving new streams while reporting NOT_SERVING, so Envoy's health
    checks (every 1 s, two misses) and Kubernetes stop sending before it refuses anything
    (keep the pod's terminationGracePeriodSeconds above `drain_bound_s`).
    `grace_s`: how long SIGTERM then waits for open streams; `response_grace_s`: how long
    instead while a stream carries a response body through the picker (the gateways'
    FULL_DUPLEX_STREAMED response bodies: such a stream lasts to the response's end, and one
    still open at the bound has its response reset; server/drain.py). `admin_port`:
    Prometheus `/metrics` and the explain API (0 = any free port, None = off). `tls`: see
    `TLSSettings`; when unset the ext_proc port still speaks TLS, with a self-signed
    certificate made at start. `plaintext: true` is the explicit choice of no TLS (a sidecar
    mesh that encrypts for us, or a test).

    Hostile clients (docs/security.md): `body_budget_bytes` bounds the request-body bytes all
    open streams buffer together (past it: 503 `body_budget_exhausted`); `body_timeout_s` is
    how long a stream may take from its request headers to the end of its body (past it: 408
    `request_body_timeout`, and the buffered chunks are freed). `explain_tokens`: values of the
    `x-extproc-explain` request header that get the decision back in `x-extproc-decision`
    (empty: nobody, the default; the explanation reveals every endpoint, score and prefix
    match). `admin_host`: where the admin port binds (loopback by default: it serves the
    explain API and state without authentication). `admin_explain_max_bytes`: the largest
    body `POST /debug/explain` accepts. `allowed_clients`: IPs/CIDRs that may open ext_proc
    streams (the Envoy pods); empty = anyone who can connect. `max_streams`: ext_proc
    streams open at once in this process; past it a new request gets 503
    `picker_streams_full` (a stream held to its response's end costs 20-30 KiB: 40,000 about
    1 GiB, docs/reliability.md). `worker_port`: a second
    ext_proc port this process alone serves (`--worker-ports BASE`: worker i of `--workers N`
    at BASE + i), so a proxy can balance streams over workers (docs/operations.md, Workers).

    A stuck serving loop (server/watchdog.py): `loop_stall_s` is how long the event loop may
    go without turning before the stall is logged (with the loop's stack) and counted;
    `loop_stall_exit_s` how long before `extproc serve` exits (code 70) so the streams it
    holds fail at once and a fresh process takes over (None: never). Keep the exit bound
    above the longest legitimate pause of the loop.
    """

    host: str = "0.0.0.0"
    port: _Port = 9002
    health_port: _Port = 9003
    admin_port: _Port | None = 9090
    max_body_bytes: Annotated[int, msgspec.Meta(gt=0)] = 64 * MiB
    fallbacks: Annotated[int, msgspec.Meta(ge=0, le=16)] = 0
    grace_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    response_grace_s: Annotated[float, msgspec.Meta(ge=0)] = 300.0
    drain_delay_s: Annotated[float, msgspec.Meta(ge=0)] = 3.0
    tls: TLSSettings | None = None
    plaintext: bool = False
    body_budget_bytes: Annotated[int, msgspec.Meta(gt=0)] = 256 * MiB
    body_timeout_s: _PositiveS = 30.0
    explain_tokens: list[str] = msgspec.field(default_factory=list)
    admin_host: str = "127.0.0.1"
    admin_explain_max_bytes: Annotated[int, msgspec.Meta(gt=0)] = 4 * MiB
    allowed_clients: list[str] = msgspec.field(default_factory=list)
    max_streams: Annotated[int, msgspec.Meta(gt=0)] = 40_000
    worker_port: _Port | None = None
    loop_stall_s: _PositiveS = 2.0
    loop_stall_exit_s: _PositiveS | None = 30.0

    def __post_init__(self) -> None:
        import ipaddress

        if self.loop_stall_exit_s is not None and self.loop_stall_exit_s <= self.loop_stall_s:
            raise ValueError("loop_stall_exit_s must be longer than loop_stall_s")

        if self.plaintext and self.tls is not None:
            raise ValueError("set either tls or plaintext: true, not both")
        for c in self.allowed_clients:
            try:
                ipaddress.ip_network(c.strip(), strict=False)
            except ValueError:
                raise ValueError(f"allowed_clients: not an IP address or CIDR: {c!r}") from None
        if any(len(t) < 16 for t in self.explain_tokens):
            raise ValueError("explain_tokens: each token needs at least 16 characters")

    @property
    def drain_bound_s(self) -> float:
        """The longest a SIGTERM drain can take: serving on for `drain_delay_s`, then the
        longer of the two waits for open streams."""
        return self.drain_delay_s + max(self.grace_s, self.response_grace_s)

    @property
    def effective_tls(self) -> TLSSettings | None:
        """What the ext_proc port serves: the configured TLS, self-signed by default, None
        only for an explicit `plaintext: true`."""
        if self.plaintext:
            return None
        return self.tls or TLSSettings(self_signed=True)


class KVEventSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Precise mode: subscribe to each endpoint's vLLM KV events.

    Each endpoint `ip:port` publishes on `tcp://ip:<port>` (vLLM's default 5557), with an
    optional replay ROUTER on `replay_port`. `bind` (e.g. `tcp://*:5557`) instead binds one
    socket that pods connect to (topic `kv@<ip>@<model>`); with `bind`, `replay_port` is
    dialed on each publisher's host, which recovers the batches a connecting publisher
    drops before its subscription handshake (vLLM's first after every start). Keys are
    recomputed from token ids
    with the tokenizer in `parse.precise`, whose `model` and `block_size` apply here too.
    `credit_placements` (true): the picker's own placements correct the events' picture
    until the events catch up: blocks just placed count until the request's response, and
    a match the work placed since will evict (by the endpoint's KV capacity) is cut
    (`extproc/index/placed.py`, docs/index.md); false routes on the events alone.
    """

    port: _Port = 5557
    replay_port: _Port | None = None
    bind: str | None = None
    # Bound socket only: CURVE with this picker's Z85 secret key, admitting only publishers
    # whose public keys are listed (docs/security.md). Messages are always checked against
    # the pool and the publisher's address, with or without CURVE.
    curve_secret_key: str | None = None
    curve_publisher_keys: list[str] = msgspec.field(default_factory=list)
    credit_placements: bool = True

    def __post_init__(self) -> None:
        if self.curve_secret_key is not None and self.bind is None:
            raise ValueError("curve_secret_key needs bind (the picker is the CURVE server)")
        for k in (self.curve_secret_key or "", *self.curve_publisher_keys):
            if k and len(k) != 40:
                raise ValueError("CURVE keys are 40-character Z85 strings")


class IndexSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The global KV-block index.

    `backend`: `memory` (this process only) or `redis` (shared by every process and replica;
    `redis_url` e.g. `redis://host:6379/0`, `rediss://` for TLS, credentials in the URL;
    `cluster: true` for Redis Cluster). `record_decisions`: write each decision's blocks for the
    chosen endpoint (approximate mode); defaults to on unless KV events are configured.
    `approx_ttl_s`: how long a recorded decision counts as cached. `capacity_blocks`: per
    endpoint, the most block keys kept. `tier_weights`: weight per medium of a matched block.
    `lookup_budget_s`, `lookup_budget_max_s`: a Redis lookup slower than its budget is answered
    degraded (routing goes on by load); the budget is twice the p90 of recently answered
    lookups, within these bounds (`index/lookup_health.py`).
    `lookup_budget`: `fixed` keeps `lookup_budget_s` for every request; `prefill` lets a
    lookup run up to the request's prompt prefill time at the fleet's measured speed when
    that is longer (what a lookup can save at most; opt-in until measured faster).
    `capacity_first_tokens` (approximate mode; None: off): until the KV-capacity ratio (real
    tokens per estimated token, which sizes what the index credits each server with) is
    first measured, measure it at every decision and trust it from this many estimated
    tokens placed (and 4 requests finished and placed) instead of 20,000 every 32
    decisions (`index/capacity.py`); opt-in on one replica (bench/RESULTS.md, issue 14,
    twelfth and thirteenth sessions). With `state.shared_calibration` pooling peers'
    placements the first measurement comes early from 4,000 tokens anyway (this setting, when
    set, gives the threshold).
    """

    backend: Literal["memory", "redis"] = "memory"
    redis_url: str | None = None
    cluster: bool = False
    record_decisions: bool | None = None
    approx_ttl_s: _PositiveS = _INDEX_DEFAULTS.approx_ttl_s
    capacity_blocks: Annotated[int, msgspec.Meta(gt=0)] | None = DEFAULT_CAPACITY_BLOCKS
    tier_weights: dict[str, float] = msgspec.field(
        default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS)
    )
    lookup_budget_s: _PositiveS = DEFAULT_LOOKUP_BUDGET_S
    lookup_budget_max_s: _PositiveS = DEFAULT_LOOKUP_BUDGET_MAX_S
    lookup_budget: Literal["prefill", "fixed"] = "fixed"
    capacity_first_tokens: Annotated[int, msgspec.Meta(gt=0)] | None = None
    kv_events: KVEventSettings | None = None


class StateSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Live endpoint state.

    `scrape`: poll each endpoint's `/metrics` (None turns scraping off: load is then known
    from in-flight counts only). `shared_inflight`: with a Redis index, in-flight counts are
    shared by every picker process and replica through Redis (None keeps them per process).
    `exclude_failing`: endpoints whose last scrape failed get no new requests while any other
    endpoint is healthy (a dead server stops receiving traffic within one scrape interval).
    `request_end`: when a placement stops counting in flight (the gateway's access log, see
    `endpoints/request_end.py`). `shared_observations`: with a Redis index, replicas share
    prefill-speed samples and new-prefix picks (`server/shared_observations.py`). `auto`: on
    whenever the index is a non-Cluster Redis index and the scheduler has something to share
    (a `no-hit-lru-scorer`, or a reader of prefill speeds: `predicted-ttft-scorer`,
    `index.lookup_budget: prefill`, flow control), off otherwise, said in a log line at start;
    `true` / `false` force it. `auto` is the default (why: beside the field below).
    `shared_placements`: with a Redis index, replicas share `predicted-ttft-scorer`'s
    placements, so each one's prefill queues and written tokens cover every replica's
    (`server/shared_placements.py`); off by default: in the seventh session's interleaved
    runs it made the replicas agree but TTFT p90 was not better (bench/RESULTS.md, issue 14).
    `shared_calibration`: with a Redis index, replicas pool approximate mode's calibration
    (every replica's placements in every replica's windows, paired with the engines' counts
    once their replica says they completed where it learns request ends, confirmed
    bytes-per-token adopted by the peers, a starting replica reads the fleet's value:
    `server/shared_calibration.py`;
    the KV-capacity model then measures its first ratio early, as `index.capacity_first_tokens`
    4,000 would). `auto` (default): on whenever the index is a non-Cluster Redis index and
    calibration is on, off otherwise, said in a log line at start; `true` / `false` force it
    (bench/RESULTS.md, issue 14, fourteenth session).
    `shared_scrapes`: with a non-Cluster Redis index and shared in-flight counts, the
    replicas alive in the in-flight exchange divide the servers' scrapes among themselves,
    each scraping its share and passing the figures to the others; a server whose figures
    stop coming for `scrape.stale_after_s` is scraped by each replica itself, as with Redis
    down (`server/shared_scrapes.py`). `auto` (default): on wherever it can be, said in a
    log line at start; one replica alone scrapes everything as before; `true` / `false`
    force it (bench/RESULTS.md, issue 14, fifteenth session).
    `prefill_speed`: how the engines' prefill histograms become each endpoint's prefill
    speed (`endpoints/prefill_speed.py`): `busy` (tokens per second the engine was busy
    prefilling) or `request` (per second of each request's prefill, where prefills sharing
    engine steps each count the shared steps: a busy server reads slower).
    """

    scrape: ScrapeSettings | None = ScrapeSettings()
    prefill_speed: Literal["busy", "request"] = "busy"
    shared_inflight: SharedInFlightSettings | None = SharedInFlightSettings()
    # `auto` since the twenty-second session (bench/RESULTS.md, issue 14): on the scorecard's
    # three-replica policy, every workload, better than without in 18 of 32 pairs and worse
    # in 8 (p90 median 0.99x), 0.94-1.19x of one replica where without it ran 1.29-1.60x; the
    # first second's picks colliding for want of a peer's 2-7 a run -> 0-1. Not a fix for
    # the tenants knee (seed 2's trace pairs even).
    shared_observations: bool | Literal["auto"] = "auto"
    shared_placements: bool = False
    shared_calibration: bool | Literal["auto"] = "auto"
    shared_scrapes: bool | Literal["auto"] = "auto"
    exclude_failing: bool = True
    request_end: RequestEndSettings = msgspec.field(default_factory=RequestEndSettings)
    # GPU utilization from each endpoint host's DCGM exporter (None: not polled); turned on
    # by llm-d's dcgm-data-source plugin.
    dcgm: DCGMSettings | None = None


class DiscoverySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where endpoints come from, besides the static `endpoints` list.

    `inference_pool` (+ `namespace`, default: the pod's own; `kubeconfig` outside a cluster):
    watch that InferencePool and its Ready pods. `endpoints_file`: a YAML/JSON list of
    `ip:port` or `{address, name, labels}`, re-read when it changes.
    """

    inference_pool: str | None = None
    namespace: str | None = None
    kubeconfig: str | None = None
    endpoints_file: str | None = None


class Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # Sections are built per instance: frozen structs still hold lists and dicts
    # (allowed_clients, tier_weights), and two Settings must never share them.
    endpoints: list[str] = msgspec.field(default_factory=list)
    discovery: DiscoverySettings = msgspec.field(default_factory=DiscoverySettings)
    server: ServerSettings = msgspec.field(default_factory=ServerSettings)
    parse: ParseSettings = msgspec.field(default_factory=ParseSettings)
    index: IndexSettings = msgspec.field(default_factory=IndexSettings)
    state: StateSettings = msgspec.field(default_factory=StateSettings)
    scheduling: EndpointPickerConfig | None = None
    disabled_plugins: list[str] = msgspec.field(default_factory=list)
    # Flow control (docs/flow-control.md); also on when `scheduling` has `flowControl`.
    flow_control: FlowControlSettings | None = None
    # Where an llm-d token-producer's modelName is looked up (a folder per model, or the
    # Hugging Face cache layout); tokenizers are never downloaded at serve time.
    tokenizer_dirs: list[str] = msgspec.field(
        default_factory=lambda: ["/models", "~/.cache/huggingface/hub"]
    )
    # Set by the loader, not written by hand: what runs with less than the config asked for
    # (e.g. precise prefix matching without a local tokenizer). Logged and exported by serve.
    degraded: list[str] = msgspec.field(default_factory=list)


# -- a document examined in one pass: every problem, llm-d sections translated --------


@dataclass(slots=True)
class Examined:
    """`settings` is None when there are problems. `degraded` lists what runs with less than
    the config asked for (e.g. no local tokenizer: approximate prefix keys), each said at
    start-up by `serve` and counted in `extproc_llmd_degraded`."""

    settings: Settings | None
    problems: list[ConfigError] = field(default_factory=list)
    translation: Translation | None = None
    wrapped: bool = False
    notes: list[str] = field(default_factory=list)
    degraded: list[str] = field(default_factory=list)


def find_tokenizer(model: str, dirs: list[str]) -> Path | None:
    """A local folder holding `model`'s tokenizer.json: `<dir>/<model>`, the Hugging Face
    cache layout `<dir>/models--org--name/snapshots/*`, or `<dir>/<name>`. Never downloads."""
    if not model:
        return None
    name = model.rsplit("/", 1)[-1]
    for d in dirs:
        root = Path(d).expanduser()
        for candidate in (root / model, root / name):
            if (candidate / "tokenizer.json").is_file():
                return candidate
        snapshots = root / ("models--" + model.replace("/", "--")) / "snapshots"
        if snapshots.is_dir():
            for snap in sorted(snapshots.iterdir()):
                if (snap / "tokenizer.json").is_file():
                    return snap
    return None


def apply_plumbing(
    settings: Settings, plumbing: Plumbing, ex: Examined, written: Mapping[str, Any]
) -> Settings:
    """The settings changes llm-d's data-plumbing plugins and sections imply. Settings the
    user wrote in our own sections (`written`: the document as parsed, outside `scheduling`)
    win over what llm-d's config implies only for `parse.precise` and
    `state.shared_inflight.interval_s`."""
    parse, index, state, discovery = (
        settings.parse,
        settings.index,
        settings.state,
        settings.discovery,
    )
    mode = plumbing.index_mode
    if mode == "precise" and parse.precise is None:
        model = plumbing.precise_model or ""
        found = find_tokenizer(model, settings.tokenizer_dirs)
        if found is None:
            why = (
                "no model name (token-producer modelName)"
                if not model
                else (
                    f"no local tokenizer for model {model!r} (looked in "
                    f"{', '.join(settings.tokenizer_dirs)})"
                )
            )
            ex.degraded.append(
                f"precise prefix cache: {why}; prefix matching uses approximate keys from "
                "routing decisions instead"
            )
            mode = "approximate"
        else:
            parse = msgspec.structs.replace(
                parse,
                precise=PreciseSettings(
                    tokenizer_dir=str(found),
                    model=model,
                    block_size=plumbing.precise_block_size or 16,
                ),
            )
            ex.notes.append(f"precise tokenizer for {model!r}: {found}")
    if mode == "precise" and parse.precise is not None and index.kv_events is None:
        bind = plumbing.kv_events_bind or "tcp://*:5557"
        index = msgspec.structs.replace(index, kv_events=KVEventSettings(bind=bind))
        ex.notes.append(f"KV events: subscriber binds {bind} (vLLM publishes to it)")
    if mode == "approximate" and index.kv_events is None:
        index = msgspec.structs.replace(index, record_decisions=True)
    if plumbing.block_tokens:
        parse = msgspec.structs.replace(parse, block_tokens=plumbing.block_tokens)
    elif plumbing.block_chars:
        # extproc's approximate blocks are bytes_per_token bytes per token.
        tokens = max(1, round(plumbing.block_chars / parse.bytes_per_token))
        parse = msgspec.structs.replace(parse, block_tokens=tokens)
    if plumbing.max_prefix_blocks:
        parse = msgspec.structs.replace(parse, max_blocks=plumbing.max_prefix_blocks)
    elif plumbing.max_prefix_tokens:
        blocks = math.ceil(plumbing.max_prefix_tokens / parse.block_tokens)
        parse = msgspec.structs.replace(parse, max_blocks=max(1, blocks))
    if plumbing.capacity_blocks:
        index = msgspec.structs.replace(index, capacity_blocks=plumbing.capacity_blocks)
    if state.scrape is not None:
        changes: dict[str, Any] = {}
        if plumbing.scrape_scheme:
            changes["scheme"] = plumbing.scrape_scheme
        if plumbing.scrape_path:
            changes["path"] = plumbing.scrape_path
        if plumbing.scrape_interval_s:
            changes["interval_s"] = plumbing.scrape_interval_s
        if plumbing.scrape_tls_verify is not None:
            changes["tls_verify"] = plumbing.scrape_tls_verify
        if plumbing.scrape_tls_ca_file:
            changes["tls_ca_file"] = plumbing.scrape_tls_ca_file
        if changes:
            state = msgspec.structs.replace(
                state, scrape=msgspec.structs.replace(state.scrape, **changes)
            )
    if plumbing.dcgm and state.dcgm is None:
        dcgm: dict[str, Any] = {}
        for key, value in (
            ("scheme", plumbing.dcgm_scheme),
            ("path", plumbing.dcgm_path),
            ("port", plumbing.dcgm_port),
            ("interval_s", plumbing.dcgm_interval_s),
            ("tls_verify", plumbing.dcgm_tls_verify),
        ):
            if value is not None:
                dcgm[key] = value
        state = msgspec.structs.replace(state, dcgm=msgspec.convert(dcgm, DCGMSettings))
    if plumbing.endpoints_file and discovery.endpoints_file is None:
        discovery = msgspec.structs.replace(discovery, endpoints_file=plumbing.endpoints_file)
    if plumbing.shared_inflight_interval_s is not None:
        state = _shared_inflight_interval(state, plumbing.shared_inflight_interval_s, ex, written)
    return msgspec.structs.replace(
        settings, parse=parse, index=index, state=state, discovery=discovery
    )


def _shared_inflight_interval(
    state: StateSettings, interval_s: float, ex: Examined, written: Mapping[str, Any]
) -> StateSettings:
    """llm-d's dataLayer.crossReplicaSyncInterval as state.shared_inflight.interval_s, unless
    the user set ours or turned sharing off; check-config says which."""
    name = "dataLayer.crossReplicaSyncInterval"
    ours = (written.get("state") or {}).get("shared_inflight") or {}
    if state.shared_inflight is None:
        ex.notes.append(f"{name} ignored: state.shared_inflight is null (counts per process)")
        return state
    if "interval_s" in ours:
        ex.notes.append(
            f"{name} ignored: state.shared_inflight.interval_s is set "
            f"({state.shared_inflight.interval_s:g} s)"
        )
        return state
    shared = msgspec.structs.replace(state.shared_inflight, interval_s=interval_s)
    ex.notes.append(
        f"{name}: state.shared_inflight.interval_s = {interval_s:g} s (in-flight counts "
        "exchanged through a Redis index; placements are still pushed to peers at once)"
    )
    return msgspec.structs.replace(state, shared_inflight=shared)


def examine(doc: Any) -> Examined:
    """Decode, translate and validate a parsed YAML document, collecting every problem."""
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        return Examined(None, [ConfigError("expected a mapping at the top level")])
    bare = doc.get("kind") == "EndpointPickerConfig" or (
        "scheduling" not in doc and ("plugins" in doc or "schedulingProfiles" in doc)
    )
    wrapped = not bare
    raw_sched = doc.get("scheduling") if wrapped else doc
    rest = {k: v for k, v in doc.items() if k != "scheduling"} if wrapped else {}
    ex = Examined(None, wrapped=wrapped)
    try:
        settings = msgspec.convert(rest, Settings)
    except msgspec.ValidationError as exc:
        ex.problems.append(validation_error(exc, ()))
        settings = None
    if raw_sched is None:
        if settings is not None:
            for build in (build_configured_scheduler, build_configured_flow_control):
                try:
                    build(settings)
                except ConfigError as exc:
                    ex.problems.append(exc)
        ex.settings = None if ex.problems else settings
        return ex
    disabled = settings.disabled_plugins if settings is not None else []
    registry = PluginRegistry.default(disabled=disabled)
    t = translate(raw_sched, registry, foreign=FLOW_PLUGIN_TYPES)
    ex.translation = t
    ex.notes.extend(t.notes)
    ex.problems.extend(ConfigError(p.message, path=("scheduling", *p.path)) for p in t.problems)
    if ex.problems or settings is None or t.config is None:
        return ex
    settings = msgspec.structs.replace(settings, scheduling=t.config)
    settings = apply_plumbing(settings, t.plumbing, ex, rest)
    for build in (build_configured_scheduler, build_configured_flow_control):
        try:
            build(settings)
        except ConfigError as exc:
            ex.problems.append(exc)
    if ex.problems:
        return ex
    if ex.degraded:
        settings = msgspec.structs.replace(settings, degraded=list(ex.degraded))
    ex.settings = settings
    return ex


def decode_settings(doc: Any) -> Settings:
    """A parsed YAML document -> Settings: decoded, the scheduling section translated from
    llm-d's shape (scheduling.llmd), validated. Raises the first problem; use
    `load_settings` (all problems, with lines) or `examine` for all."""
    ex = examine(doc)
    if ex.problems:
        raise ex.problems[0]
    assert ex.settings is not None  # no problems means settings were built
    return ex.settings


def build_configured_scheduler(settings: Settings) -> Scheduler:
    """Stage 2: plugins and profiles (the registry includes installed third-party plugins)."""
    registry = PluginRegistry.default(disabled=settings.disabled_plugins)
    try:
        return build_scheduler(
            settings.scheduling or default_config(),
            registry,
            fallbacks=settings.server.fallbacks,
            foreign=FLOW_PLUGIN_TYPES,
        )
    except ConfigError as exc:
        raise exc.within("scheduling") if settings.scheduling else exc from None


def flow_control_configured(settings: Settings) -> bool:
    """Whether flow control is on: the scheduling config has a `flowControl` or
    `saturationDetector` section or lists an admitter plugin, or the settings have a
    `flow_control` section."""
    sched = settings.scheduling
    if settings.flow_control is not None:
        return True
    if sched is None:
        return False
    return (
        sched.flowControl is not None
        or sched.saturationDetector is not None
        or any(msgspec.to_builtins(p)["type"] in ADMITTER_TYPES for p in sched.plugins)
    )


def build_configured_flow_control(settings: Settings) -> FlowConfig | None:
    """Stage 2 for flow control: None (off) unless `flow_control_configured`."""
    if not flow_control_configured(settings):
        return None
    sched = settings.scheduling
    fc = sched.flowControl if sched else None
    sd = sched.saturationDetector if sched else None
    plugins = [msgspec.to_builtins(p) for p in sched.plugins] if sched else []
    try:
        return build_flow_config(fc, sd, plugins, settings.flow_control)
    except ConfigError as exc:
        raise exc.within("scheduling") if sched else exc from None


def _line_of(text: str, path: tuple[str | int, ...]) -> int | None:
    """1-based line of the deepest node along `path` in a YAML text (best effort)."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    if node is None:
        return None
    bare = isinstance(node, yaml.MappingNode) and not any(
        getattr(k, "value", None) == "scheduling" for k, _ in node.value
    )
    if bare and path and path[0] == "scheduling":
        path = path[1:]  # a bare EndpointPickerConfig: scheduling is the document
    line = node.start_mark.line + 1
    for part in path:
        child = None
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if getattr(k, "value", None) == part:
                    child = v
                    line = k.start_mark.line + 1
                    break
        elif (
            isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value)
        ):
            child = node.value[part]
            line = child.start_mark.line + 1
        if child is None:
            break
        node = child
    return line


def read_document(path: str | Path) -> tuple[str, Any]:
    """(text, parsed YAML) of a config file; ConfigError naming the file when unreadable."""
    try:
        text = Path(path).read_text()
        return text, yaml.safe_load(text)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from None


def locate(path: str | Path, text: str, exc: ConfigError, *, bare: bool = False) -> str:
    """`file:line: field: message` for one problem (`bare`: the document is an
    EndpointPickerConfig itself, so fields are shown without `scheduling.`)."""
    line = _line_of(text, exc.path)
    where = f"{path}:{line}" if line else str(path)
    shown = exc.path[1:] if bare and exc.path[:1] == ("scheduling",) else exc.path
    field = f" {format_path(shown)}:" if shown else ""
    return f"{where}:{field} {exc.message}"


def load_settings(path: str | Path | None) -> Settings:
    """Decode and validate a YAML file (plugins are built once to check them); `None`
    gives the defaults. Raises one ConfigError listing every problem, each with file, line
    and field."""
    if path is None:
        return Settings()
    text, doc = read_document(path)
    ex = examine(doc)
    if ex.problems:
        bare = not ex.wrapped
        raise ConfigError("\n".join(locate(path, text, p, bare=bare) for p in ex.problems))
    assert ex.settings is not None
    return ex.settings
