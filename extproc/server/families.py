"""Which stats field of which component becomes which Prometheus metric family.

Every component keeps its counters in a stats dataclass (`RouterStats`, `IndexStats`, ...)
that the hot path bumps for free; the metrics exporter (server/exporter.py) reads them at
scrape time through the tables here. One table per stats class names, for each field, its
metric family, or says in `unexported` why it has none. tests/server/test_families.py walks
every stats dataclass of the package and fails on a field in neither place, so a counter
added without a metric is caught, not silently dropped from /metrics.

A field's value may be a number (one sample, with fixed label values when several fields
share a family) or a dict (one sample per key; a tuple key fills several labels).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

Family = CounterMetricFamily | GaugeMetricFamily


@dataclass(frozen=True, slots=True)
class Stat:
    """One field's metric. `labels`: the label names of a dict field's keys, or of `values`
    (the fixed label values of a number field sharing its family with others). `keys`: dict
    keys always exported (0 until seen), so `rate()` has a series from the start."""

    name: str
    doc: str
    kind: Literal["counter", "gauge"] = "counter"
    labels: tuple[str, ...] = ()
    values: tuple[str, ...] = ()
    keys: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class StatsFamilies:
    """The export table of one stats class: `exported` maps a field to its metric,
    `unexported` maps a field to the reason it has none."""

    stats: str  # the stats class, by dotted name: imported by the test, not here
    exported: Mapping[str, Stat]
    unexported: Mapping[str, str] = field(default_factory=dict)

    def families(self, stats: Any, by: tuple[str, str] | None = None) -> list[Metric]:
        """The families of one component's stats; `by` = (label, value) adds a label every
        sample carries (several components of one kind, e.g. two Kubernetes watches)."""
        return self.families_of([stats], by[0] if by else None, [by[1]] if by else None)

    def families_of(
        self, many: Sequence[Any], by: str | None = None, values: Sequence[str] | None = None
    ) -> list[Metric]:
        """`many` components' stats in one set of families, told apart by the label `by`
        with `values` (one each); without `by`, numbers are summed over them."""
        built: dict[str, Family] = {}
        extra = [by] if by else []
        for name, stat in self.exported.items():
            family = built.get(stat.name)
            if family is None:
                make = CounterMetricFamily if stat.kind == "counter" else GaugeMetricFamily
                family = built[stat.name] = make(stat.name, stat.doc, labels=[*stat.labels, *extra])
            if by is None and len(many) > 1:
                total = sum(getattr(s, name) for s in many)
                family.add_metric(list(stat.values), total)
                continue
            for i, s in enumerate(many):
                tail = [values[i]] if by and values else []
                _add(family, stat, getattr(s, name), tail)
        return list(built.values())


def _add(family: Family, stat: Stat, value: Any, tail: list[str]) -> None:
    if isinstance(value, Mapping):
        items = {**dict.fromkeys(stat.keys, 0), **value}
        for key, v in sorted(items.items(), key=lambda kv: str(kv[0])):
            labels = [str(k) for k in key] if isinstance(key, tuple) else [str(key)]
            family.add_metric([*labels, *tail], v)
    else:
        family.add_metric([*stat.values, *tail], value)


ROUTER = StatsFamilies(
    "extproc.router.RouterStats",
    {
        "decisions": Stat("extproc_decisions", "Decisions made (requests routed)."),
        "lookups_degraded": Stat(
            "extproc_index_lookups_degraded",
            "Index lookups answered degraded (Redis slow or down): routed on load alone.",
        ),
        "prefix_blocks_requested": Stat(
            "extproc_prefix_blocks_requested", "Block keys of routed requests."
        ),
        "prefix_blocks_matched": Stat(
            "extproc_prefix_blocks_matched",
            "Tier-weighted blocks the chosen endpoint held (hit ratio = matched / requested).",
        ),
        "served_elsewhere": Stat(
            "extproc_served_elsewhere",
            "Requests the proxy reported served by another endpoint than the pick (a retry "
            "walked the fallback list); in-flight and index followed the served one.",
        ),
        "response_headers_unsent": Stat(
            "extproc_response_headers_unsent",
            "Decisions whose response headers (session token, predicted TTFT) never reached "
            "the client: the proxy skips the response-header phase (envoy-config "
            "--response-headers send keeps it).",
        ),
        "admissions_without_response": Stat(
            "extproc_admissions_without_response",
            "Flow-control tickets released at a stream that ended before the response headers "
            "(client gone, or the proxy skips that phase: admission and eviction then end at "
            "the decision).",
        ),
    },
)

INDEX = StatsFamilies(
    "extproc.index.base.IndexStats",
    {
        "lookups": Stat("extproc_index_lookups", "Index lookups made."),
        "writes_dropped": Stat(
            "extproc_index_writes_dropped", "Index writes dropped (queue full)."
        ),
        "write_errors": Stat("extproc_index_write_errors", "Index write batches that failed."),
        "batches": Stat("extproc_index_write_batches", "Index write batches applied."),
        "evicted_blocks": Stat(
            "extproc_index_evicted_blocks",
            "Block entries evicted to keep an endpoint within capacity_blocks.",
        ),
        "lookups_timed_out": Stat(
            "extproc_index_lookups_timed_out",
            "Index lookups answered degraded because Redis did not answer within the budget.",
        ),
        "lookups_failed": Stat(
            "extproc_index_lookups_failed",
            "Index lookups answered degraded because of a Redis error (the breaker opens).",
        ),
        "lookups_late": Stat(
            "extproc_index_lookups_late",
            "Timed-out index lookups whose answer came back later, in the background.",
        ),
        "lookups_in_grace": Stat(
            "extproc_index_lookups_in_grace",
            "Index lookups answered in a second budget given because the event loop woke the "
            "first one late (the loop was starved, not Redis): used, not degraded.",
        ),
        "lookup_budget_s": Stat(
            "extproc_index_lookup_budget_seconds",
            "The current Redis lookup budget: twice the p90 of answered lookups, within "
            "index.lookup_budget_s and lookup_budget_max_s (0: a local index).",
            kind="gauge",
        ),
        "degraded": Stat(
            "extproc_index_degraded",
            "1 while the Redis index's lookups (answered degraded: routed on load) or writes "
            "(queued and retried, dropped after write_retry_s) fail; 0 once one goes through.",
            kind="gauge",
            labels=("direction",),
            keys=("lookups", "writes"),
        ),
        "outages": Stat(
            "extproc_index_outages",
            "Failing spells of the Redis index's lookups or writes (each logged when it "
            "starts and when it ends, with how long and what was skipped).",
            labels=("direction",),
            keys=("lookups", "writes"),
        ),
    },
    {
        # The router counts the same degraded answers (every lookup goes through it).
        "lookups_degraded": "RouterStats.lookups_degraded: extproc_index_lookups_degraded",
    },
)


def _kv(name: str, doc: str, kind: Literal["counter", "gauge"] = "counter") -> Stat:
    return Stat(f"extproc_kv_events_{name}", doc, kind)


KV_EVENTS = StatsFamilies(
    "extproc.index.kvevents.IngestStats",
    {
        "messages": _kv("messages", "KV-event messages received."),
        "events": _kv("events", "KV events decoded from the messages."),
        "blocks_stored": _kv("blocks_stored", "BlockStored blocks ingested."),
        "blocks_removed": _kv("blocks_removed", "BlockRemoved blocks ingested."),
        "duplicate_stores": _kv(
            "duplicate_stores", "BlockStored blocks the endpoint already held (a second copy)."
        ),
        "orphan_blocks": _kv(
            "orphan_blocks",
            "Stored blocks whose parent was never seen (a lost BlockStored): not keyable.",
        ),
        "unknown_removals": _kv(
            "unknown_removals", "BlockRemoved blocks the index did not know for the endpoint."
        ),
        "malformed": _kv("malformed", "KV-event frames or events that could not be decoded."),
        "duplicate_messages": _kv(
            "duplicate_messages", "KV-event batches received twice (same sequence)."
        ),
        "late_messages": _kv(
            "late_messages", "KV-event batches behind the last one and stamped earlier: ignored."
        ),
        "lag_s": _kv(
            "lag_seconds",
            "Publisher timestamp to ingestion of the latest KV-event batch (host clocks).",
            "gauge",
        ),
        "gaps": _kv("gaps", "KV-event sequence gaps."),
        "replayed": _kv("replayed", "KV-event batches recovered by replay."),
        "resyncs": _kv("resyncs", "Endpoints rebuilt after an unrecoverable gap."),
        "restarts": _kv("restarts", "Publisher restarts seen (sequence went back)."),
        "disconnects": _kv(
            "disconnects",
            "Connections to dialed KV-event publishers lost (each logged, and its return; "
            "ZMQ reconnects by itself).",
        ),
        "publishers_down": _kv(
            "publishers_disconnected",
            "Dialed KV-event publishers disconnected now: their engines' cache changes are "
            "not seen until they reconnect.",
            "gauge",
        ),
        "clears": _kv(
            "clears", "AllBlocksCleared events applied (the endpoint's entries dropped)."
        ),
        "rejected": _kv(
            "rejected",
            "KV-event messages refused: topic names no pool endpoint, or sent from another "
            "address than that endpoint's.",
        ),
    },
)

SCRAPE = StatsFamilies(
    "extproc.endpoints.scrape.ScrapeStats",
    {
        "scrapes": Stat("extproc_scrapes", "Successful endpoint metrics scrapes."),
        "failures": Stat("extproc_scrape_failures", "Failed endpoint metrics scrapes."),
        "unchanged": Stat(
            "extproc_scrape_unchanged",
            "Scrapes whose body equalled the endpoint's previous one (hashed, not parsed).",
        ),
        "parse_cpu_s": Stat(
            "extproc_scrape_parse_cpu_seconds",
            "CPU seconds spent hashing, parsing and storing scraped bodies.",
        ),
        "connects": Stat(
            "extproc_scrape_connections",
            "Connections opened to endpoints' metrics ports (kept alive across scrapes).",
        ),
        "invalidations": Stat(
            "extproc_endpoint_cache_invalidations",
            "Endpoints whose index entries were dropped: restart (process start time changed) "
            "or unreachable (a scrape failed).",
            labels=("reason",),
            keys=("restart", "unreachable"),
        ),
        "invalidate_failures": Stat(
            "extproc_endpoint_cache_invalidation_failures",
            "Invalidations whose index call raised (logged with the traceback): the "
            "endpoint's old blocks may still be credited to it.",
        ),
    },
)

DCGM = StatsFamilies(
    "extproc.endpoints.dcgm.DCGMStats",
    {
        "polls": Stat("extproc_dcgm_polls", "DCGM exporter polls made."),
        "failures": Stat(
            "extproc_dcgm_failures",
            "DCGM polls without a GPU utilization (the endpoint's GPUUtilization is missing "
            "until one succeeds).",
        ),
    },
)

REQUEST_ENDS = StatsFamilies(
    "extproc.endpoints.request_end.RequestEndStats",
    {
        "held": Stat(
            "extproc_request_end_held",
            "Placements held past their ext_proc stream, waiting for the access-log entry.",
            "gauge",
        ),
        "ended": Stat(
            "extproc_request_end_ended", "Held placements released by their access-log entry."
        ),
        "expired": Stat(
            "extproc_request_end_expired",
            "Held placements released by max_hold_s: their access-log entry never came.",
        ),
        "entries": Stat("extproc_access_log_entries", "Access-log entries received."),
        "unmatched": Stat(
            "extproc_access_log_unmatched",
            "Access-log entries for requests this process did not hold.",
        ),
        "cut": Stat(
            "extproc_request_end_cut",
            "Access-log entries with a 2xx status (or none) whose response flags say the "
            "response stopped short, by reason (client: the client hung up; upstream: the "
            "server reset or closed it; timeout; proxy: Envoy reset it): not completed.",
            labels=("reason",),
            keys=("client", "upstream", "timeout", "proxy"),  # request_end.CUT_REASONS
        ),
    },
)

SHARED_REQUEST_ENDS = StatsFamilies(
    "extproc.endpoints.shared_request_end.SharedEndStats",
    {
        "published": Stat(
            "extproc_request_end_forwarded",
            "Unmatched access-log entries published to the other replicas.",
        ),
        "applied": Stat(
            "extproc_request_end_forward_applied",
            "Holds released by an entry another replica received.",
        ),
        "dropped": Stat(
            "extproc_request_end_forward_dropped",
            "Entries that could not be published (Redis failing or backlog full).",
        ),
        # Named after the request-end families' first form (forwarded, forward_*), not
        # extproc_shared_*: the degraded gauge alone says an outage is on, not how long.
        "errors": Stat(
            "extproc_request_end_forward_errors",
            "Failed publishes or subscriptions of forwarded request ends.",
        ),
        "bad_entries": Stat(
            "extproc_request_end_forward_bad_entries",
            "Peers' forwarded entries refused (undecodable message or entry): skipped, "
            "their holds expire at max_hold_s.",
        ),
    },
)

SHARED_INFLIGHT = StatsFamilies(
    "extproc.endpoints.shared_inflight.SharedInFlightStats",
    {
        "errors": Stat(
            "extproc_shared_inflight_errors", "Failed exchanges of in-flight counts with Redis."
        ),
        "exchanges": Stat(
            "extproc_shared_inflight_exchanges",
            "Successful exchanges of in-flight counts with Redis.",
        ),
        "bad_entries": Stat(
            "extproc_shared_inflight_bad_entries",
            "Peers' in-flight entries in Redis that could not be decoded (skipped).",
        ),
        "peers": Stat(
            "extproc_shared_inflight_peers",
            "Other picker processes seen at the last exchange.",
            "gauge",
        ),
        "legacy_peers": Stat(
            "extproc_shared_inflight_legacy_peers",
            "Of those, processes publishing no placement counters (an older version): their "
            "arrivals are dated by the growth of their in-flight totals.",
            "gauge",
        ),
        "placed": Stat(
            "extproc_shared_inflight_placed",
            "Requests this process placed (its published cumulative counter).",
        ),
        "placed_tokens": Stat(
            "extproc_shared_inflight_placed_tokens",
            "Prompt tokens this process placed (its published cumulative counter).",
        ),
        "peer_arrivals": Stat(
            "extproc_shared_inflight_peer_arrivals",
            "Requests the other processes placed, from their placement counters.",
        ),
        "peer_arrived_tokens": Stat(
            "extproc_shared_inflight_peer_arrived_tokens",
            "Prompt tokens the other processes placed, as dated arrivals (from their "
            "placement counters; older versions' from their totals' growth).",
        ),
        "peer_growth_tokens": Stat(
            "extproc_shared_inflight_peer_growth_tokens",
            "Growth of the other processes' in-flight tokens between exchanges: what dating "
            "by the totals alone would see of their arrivals.",
        ),
        "counter_resets": Stat(
            "extproc_shared_inflight_counter_resets",
            "Other processes' placement counters seen going backwards (restarted under the "
            "same id): their dating restarted from their in-flight totals.",
        ),
        "counters_pruned": Stat(
            "extproc_shared_inflight_counters_pruned",
            "Servers whose placement counters this process forgot (nothing placed or in "
            "flight there for counters_idle_s).",
        ),
        "pushed_arrivals": Stat(
            "extproc_shared_inflight_pushed_arrivals",
            "Other processes' placements counted at once from their pushes, before the "
            "exchange showed them.",
        ),
        "pushed_tokens": Stat(
            "extproc_shared_inflight_pushed_tokens",
            "Prompt tokens of the other processes' placements counted from their pushes.",
        ),
        "push_late": Stat(
            "extproc_shared_inflight_push_late",
            "Pushed placements the exchange had shown already (nothing added).",
        ),
        "push_refused": Stat(
            "extproc_shared_inflight_push_refused",
            "Pushed placements refused: from a process the exchange does not know, or "
            "growing its counters past the bounds.",
        ),
        "push_unconfirmed": Stat(
            "extproc_shared_inflight_push_unconfirmed",
            "Pushed placements no exchange confirmed within the TTL (no longer counted).",
        ),
    },
)

INFLIGHT_PUSH = StatsFamilies(
    "extproc.endpoints.inflight_push.InFlightPushStats",
    {
        "published": Stat(
            "extproc_inflight_push_published",
            "Placements pushed to the other replicas at decision time.",
        ),
        "received": Stat(
            "extproc_inflight_push_received",
            "Peers' pushed placements handed to the in-flight counts.",
        ),
        "dropped": Stat(
            "extproc_inflight_push_dropped",
            "Placements never pushed (Redis failing or backlog full).",
        ),
        "errors": Stat(
            "extproc_inflight_push_errors",
            "Failed publishes or subscriptions of pushed placements.",
        ),
        "bad_entries": Stat(
            "extproc_inflight_push_bad_entries",
            "Peers' pushed items refused for their shape (undecodable, unknown server).",
        ),
    },
)

SHARED_SESSIONS = StatsFamilies(
    "extproc.server.shared_sessions.SharedSessionsStats",
    {
        "exchanges": Stat(
            "extproc_shared_sessions_exchanges",
            "Successful exchanges of live-session placements with Redis.",
        ),
        "errors": Stat(
            "extproc_shared_sessions_errors",
            "Failed exchanges of live-session placements with Redis.",
        ),
        "published": Stat(
            "extproc_shared_sessions_published", "Session placements published to peers."
        ),
        "applied": Stat(
            "extproc_shared_sessions_applied", "Peers' session placements applied here."
        ),
        "dropped": Stat(
            "extproc_shared_sessions_dropped",
            "Session placements never published (queue full while Redis failed).",
        ),
        "bad_entries": Stat(
            "extproc_shared_sessions_bad_entries",
            "Stream entries that could not be decoded (skipped).",
        ),
    },
)

SESSION_BOUND = StatsFamilies(
    "extproc.scheduling.plugins.sessions.SessionBoundStats",
    {
        "bounded": Stat(
            "extproc_session_bound_bounded",
            "Requests starting a session on a known prefix that bounded-sessions-filter "
            "bounded (live sessions per endpoint against its share).",
        ),
        "kept_together": Stat(
            "extproc_session_bound_kept_together",
            "Requests starting a session left to the scorers: sessions on the same prefix "
            "were seen to grow little past it (keepTogetherGrowth).",
        ),
        "growth_unknown": Stat(
            "extproc_session_bound_growth_unknown",
            "Requests starting a session bounded because no session on their prefix had "
            "been seen continued (keepTogetherGrowth had nothing to go on).",
        ),
        "holders_removed": Stat(
            "extproc_session_bound_holders_removed",
            "Bounded requests whose every endpoint holding the most of the prefix was "
            "removed (the prompt is written on another server).",
        ),
        "header_growth": Stat(
            "extproc_session_bound_header_growth",
            "Requests starting a session whose expected growth was read under the prefix's "
            "first 7 blocks only (a header other prompts share: the coarsest fallback).",
        ),
        "uncontinued_learned": Stat(
            "extproc_session_bound_uncontinued_learned",
            "First turns no later turn continued within the horizon, recorded as sessions "
            "that grew 0 blocks past their first turn (learnUncontinued).",
        ),
        "uncontinued_untracked": Stat(
            "extproc_session_bound_uncontinued_untracked",
            "First turns not watched for a continuation for want of room (they teach "
            "nothing; their groups stay bounded).",
        ),
        "uncontinued_prior": Stat(
            "extproc_session_bound_uncontinued_prior",
            "Requests starting a session on a prefix nothing was recorded under, left to the "
            "scorers because none of the fleet's recent first turns came back "
            "(uncontinuedPrior).",
        ),
        "uncontinued_unclassed": Stat(
            "extproc_session_bound_uncontinued_unclassed",
            "First turns continued whose request class a peer replica did not send (an "
            "older version): each ends uncontinuedPrior for every class.",
        ),
        "reset_sessions": Stat(
            "extproc_session_bound_reset_sessions",
            "Live sessions whose endpoint restarted, left the pool or cleared its prefix "
            "cache: no longer counted there, their next turn placed as a new session's.",
        ),
        "reset_turns": Stat(
            "extproc_session_bound_reset_turns",
            "Later turns of sessions whose endpoint restarted, left or cleared its cache, "
            "placed as a new session is (on a held prefix, also bounded or kept together).",
        ),
        "uncontinued_horizon_s": Stat(
            "extproc_session_bound_uncontinued_horizon_seconds",
            "Seconds after which a first turn not continued counts as grown 0 blocks "
            "(a multiple of recent first-to-second-turn gaps, within floor and cap).",
            kind="gauge",
        ),
    },
)

SHARED_OBSERVATIONS = StatsFamilies(
    "extproc.server.shared_observations.SharedObservationsStats",
    {
        "published": Stat(
            "extproc_shared_observations_published",
            "Prefill-speed samples and new-prefix picks published to the other replicas.",
        ),
        "applied": Stat(
            "extproc_shared_observations_applied",
            "Peers' prefill-speed samples and new-prefix picks applied here.",
        ),
        "dropped": Stat(
            "extproc_shared_observations_dropped",
            "Samples and picks never published (Redis failing or backlog full).",
        ),
        "errors": Stat(
            "extproc_shared_observations_errors",
            "Failed publishes or subscriptions of shared observations.",
        ),
        "bad_entries": Stat(
            "extproc_shared_observations_bad_entries",
            "Messages or items on the observations channel that could not be decoded (skipped).",
        ),
        "unknown_endpoint": Stat(
            "extproc_shared_observations_unknown_endpoint",
            "Peers' samples and picks naming a server not in this replica's pool (skipped; "
            "routine while replicas briefly disagree on the pool).",
        ),
        "unknown_scorer": Stat(
            "extproc_shared_observations_unknown_scorer",
            "Peers' new-prefix picks for a no-hit-lru-scorer this replica's scheduler lacks "
            "(skipped; the replicas run different scheduler configs).",
        ),
    },
)

SHARED_SCRAPES = StatsFamilies(
    "extproc.server.shared_scrapes.SharedScrapesStats",
    {
        "published": Stat(
            "extproc_shared_scrapes_published",
            "Scrapes of the servers this replica owns, published to the other replicas.",
        ),
        "applied": Stat(
            "extproc_shared_scrapes_applied",
            "Peers' scrapes stored here as this replica's own would be.",
        ),
        "dropped": Stat(
            "extproc_shared_scrapes_dropped",
            "Scrapes never published (Redis failing or backlog full).",
        ),
        "errors": Stat(
            "extproc_shared_scrapes_errors",
            "Failed publishes or subscriptions of shared scrapes.",
        ),
        "bad_entries": Stat(
            "extproc_shared_scrapes_bad_entries",
            "Peers' scrapes that did not decode or held figures out of range (skipped).",
        ),
        "stale": Stat(
            "extproc_shared_scrapes_stale",
            "Peers' scrapes not applied: older than the figures stored, or of a server "
            "not in the pool.",
        ),
        "takeovers": Stat(
            "extproc_shared_scrapes_takeovers",
            "Times this replica began scraping a server a peer owns, its figures not "
            "having come within the scrape's stale_after_s (Redis failing, the owner slow "
            "or gone, or at start).",
        ),
    },
)

SHARED_CALIBRATION = StatsFamilies(
    "extproc.server.shared_calibration.SharedCalibrationStats",
    {
        "published": Stat(
            "extproc_shared_calibration_published",
            "Placements, completed requests and confirmed calibration changes published to "
            "the other replicas.",
        ),
        "applied": Stat(
            "extproc_shared_calibration_applied",
            "Peers' placements counted in this replica's calibration windows.",
        ),
        "completed": Stat(
            "extproc_shared_calibration_completed",
            "Peers' completed requests handed to this replica's calibration pairing (a "
            "placement whose replica learns its end joins the pairing once it completed).",
        ),
        "adopted": Stat(
            "extproc_shared_calibration_adopted",
            "Peers' confirmed bytes-per-token values (or the fleet's value read at start) "
            "accepted here.",
        ),
        "dropped": Stat(
            "extproc_shared_calibration_dropped",
            "Placements, completed requests and changes never published (Redis failing or "
            "backlog full).",
        ),
        "errors": Stat(
            "extproc_shared_calibration_errors",
            "Failed Redis calls of shared calibration (channel or the fleet's value key).",
        ),
        "bad_entries": Stat(
            "extproc_shared_calibration_bad_entries",
            "Peers' messages or items refused (undecodable, unknown server, implausible numbers).",
        ),
    },
)

SHARED_GROWTH = StatsFamilies(
    "extproc.server.shared_growth.SharedGrowthStats",
    {
        "published": Stat(
            "extproc_shared_growth_published",
            "Session growth records published to the other replicas (bounded-sessions-filter "
            "shareGrowth).",
        ),
        "applied": Stat(
            "extproc_shared_growth_applied",
            "Peers' session growth records merged into this replica's.",
        ),
        "dropped": Stat(
            "extproc_shared_growth_dropped",
            "Growth records never published (Redis failing or backlog full).",
        ),
        "errors": Stat(
            "extproc_shared_growth_errors",
            "Failed publishes or subscriptions of shared growth.",
        ),
        "bad_entries": Stat(
            "extproc_shared_growth_bad_entries",
            "Messages or growth records from peers refused (undecodable, unknown filter, "
            "figures out of bounds).",
        ),
        "snapshot_reads": Stat(
            "extproc_shared_growth_snapshot_reads",
            "Reads of the retained growth snapshot in Redis (on start and after each "
            "reconnect: what peers learned before this replica listened).",
        ),
        "snapshot_entries": Stat(
            "extproc_shared_growth_snapshot_entries",
            "Snapshot entries read and checked as pushed records are (accepted ones also "
            "count in applied, refused ones in bad_entries).",
        ),
        "reseeded": Stat(
            "extproc_shared_growth_reseeded",
            "Growth records sent again because the snapshot was read empty (Redis restarted "
            "without persistence, or expired): whoever starts next learns them.",
        ),
        "unretained": Stat(
            "extproc_shared_growth_unretained",
            "Growth records published but too large to keep in the snapshot (late joiners "
            "miss them).",
        ),
    },
)

SHARED_SILENCE = StatsFamilies(
    "extproc.server.shared_silence.SharedSilenceStats",
    {
        "published": Stat(
            "extproc_kv_events_silence_fleet_published",
            "Heard-count batches (one per silence check) published to the other replicas.",
        ),
        "applied": Stat(
            "extproc_kv_events_silence_fleet_heard",
            "KV-event messages the other replicas heard, counted in the fleet's silence judging.",
        ),
        "unshared": Stat(
            "extproc_kv_events_silence_fleet_unshared_placements",
            "Peers' placements left out of the fleet's silence judging: that peer's heard "
            "counts do not arrive (an older version, or its channel failing).",
        ),
        "dropped": Stat(
            "extproc_kv_events_silence_fleet_dropped",
            "Heard-count batches never published (Redis failing or backlog full).",
        ),
        "errors": Stat(
            "extproc_kv_events_silence_fleet_errors",
            "Failed publishes or subscriptions of the shared heard counts.",
        ),
        "bad_entries": Stat(
            "extproc_kv_events_silence_fleet_bad_entries",
            "Peers' heard counts refused (undecodable, not an endpoint of the pool, out of "
            "bounds).",
        ),
    },
)

SHARED_PLACEMENTS = StatsFamilies(
    "extproc.server.shared_placements.SharedPlacementsStats",
    {
        "published": Stat(
            "extproc_shared_placements_published",
            "Predicted-TTFT placements published to the other replicas.",
        ),
        "applied": Stat(
            "extproc_shared_placements_applied",
            "Peers' placements folded into this replica's prefill queues and written tokens.",
        ),
        "dropped": Stat(
            "extproc_shared_placements_dropped",
            "Placements never published (Redis failing or backlog full).",
        ),
        "errors": Stat(
            "extproc_shared_placements_errors",
            "Failed publishes or subscriptions of shared placements.",
        ),
        "bad_entries": Stat(
            "extproc_shared_placements_bad_entries",
            "Messages or placements from peers refused (undecodable, unknown server, values "
            "out of bounds).",
        ),
    },
)

CALIBRATION = StatsFamilies(
    "extproc.calibration.CalibrationStats",
    {
        "block_tokens": Stat(
            "extproc_approx_block_tokens", "Tokens per approximate block key.", "gauge"
        ),
        "bytes_per_token": Stat(
            "extproc_approx_bytes_per_token",
            "Characters per token of approximate keys and token estimates.",
            "gauge",
        ),
        "changes": Stat(
            "extproc_approx_recalibrations",
            "Changes of the approximate block size or characters per token, from the engines.",
        ),
        "adopted": Stat(
            "extproc_approx_recalibrations_adopted",
            "Of the recalibrations, bytes-per-token values adopted from peer replicas "
            "(state.shared_calibration).",
        ),
        "refused": Stat(
            "extproc_approx_calibrations_refused",
            "Peer replicas' bytes-per-token values refused: out of bounds or made for other "
            "keys (logged).",
        ),
        "windows_skipped": Stat(
            "extproc_approx_windows_skipped",
            "Calibration windows left out: engine / estimated tokens outside the plausible "
            "range (another client, a restart).",
        ),
        "unmeasured": Stat(
            "extproc_approx_unmeasured_scrapes",
            "Scrapes of engines that export no prompt-token counter: characters per token "
            "are not measured from them (each such endpoint logged once).",
        ),
        "cut": Stat(
            "extproc_approx_pairing_cut",
            "Placements left out of calibration's pairing because their request did not "
            "complete (evicted, a non-2xx status, a response flag saying it stopped short "
            "such as a client's hang-up, no access-log entry): the engine never counts a "
            "cut request.",
        ),
        "unended": Stat(
            "extproc_approx_pairing_unended",
            "Placements calibration forgot while waiting for their request's end (none came "
            "within 600 s, or 65,536 were waiting).",
        ),
        "stale": Stat(
            "extproc_approx_pairing_stale",
            "Ended placements the engine did not count, and engine counts no ended placement "
            "came for, within 5 s: dropped from calibration's pairing (logged once a minute).",
        ),
        "ratios": Stat(
            "extproc_approx_token_ratio",
            "Engine prompt tokens per estimated token in the endpoint's last window (carried "
            "into the current unit when characters per token change).",
            "gauge",
            labels=("endpoint",),
        ),
    },
)

CAPACITY = StatsFamilies(
    "extproc.index.capacity.CapacityStats",
    {
        "ratio": Stat(
            "extproc_capacity_token_ratio",
            "Engine prompt tokens per estimated token, as the KV-capacity model last measured "
            "it (an endpoint's cache in our blocks is its KV tokens / (block tokens x this)).",
            "gauge",
        ),
        "measured": Stat(
            "extproc_capacity_measurements",
            "KV-capacity ratio measurements by source: per_request (engines' prompt-token "
            "histograms) or totals (token counters only; with several picker replicas each "
            "server is under-credited).",
            labels=("source",),
        ),
    },
)

PLACED = StatsFamilies(
    "extproc.index.placed.PlacedStats",
    {
        "pending": Stat(
            "extproc_precise_placement_corrections",
            "Precise mode: decisions whose KV-event matches the picker's own placements "
            "corrected: pending (blocks placed, not yet reported, credited) or evicting (a "
            "reported match cut to what the endpoint's cache keeps after the work placed "
            "since).",
            labels=("kind",),
            values=("pending",),
        ),
        "evicting": Stat(
            "extproc_precise_placement_corrections",
            "",
            labels=("kind",),
            values=("evicting",),
        ),
    },
)

WATCH = StatsFamilies(
    "extproc.endpoints.kubernetes.WatchStats",
    {
        "lists": Stat("extproc_discovery_lists", "Kubernetes lists made by a watch."),
        "watches": Stat("extproc_discovery_watches", "Kubernetes watch connections opened."),
        "relists_gone": Stat(
            "extproc_discovery_relists_gone",
            "Relists because the API server no longer had the watched resourceVersion (410).",
        ),
        "failures": Stat(
            "extproc_discovery_failures", "Watch passes that ended in an error (then backoff)."
        ),
        "bookmarks": Stat("extproc_discovery_bookmarks", "Watch bookmarks received."),
        "changes": Stat("extproc_discovery_changes", "Changes applied from the watched resource."),
        "unusable_pods": Stat(
            "extproc_discovery_unusable_pods",
            "Ready pods the InferencePool selects that were left out of the pool at the last "
            "recompute because their podIP makes no address (0 for other resources).",
            kind="gauge",
        ),
    },
)

API_SERVER = StatsFamilies(
    "extproc.endpoints.kubernetes.ApiServerStats",
    {
        "token_read_failures": Stat(
            "extproc_discovery_token_read_failures",
            "Kubernetes API connections that found the service-account token file "
            "unreadable and sent the last token read (401s follow once it expires).",
        ),
    },
)

FLOW = StatsFamilies(
    "extproc.flowcontrol.tickets.FlowStats",
    {
        "outcomes": Stat(
            "extproc_flow_requests",
            "Flow-control outcomes: dispatched, rejected_capacity (queue full), evicted_ttl, "
            "evicted_pressure (displaced by higher priority), cancelled (client left), "
            "rejected_admitter (refused by an admitter), evicted_inflight (cut while running, "
            "enableEviction).",
            labels=("priority", "fairness_id", "outcome"),
        ),
        "wait_sum": Stat(
            "extproc_flow_wait_seconds",
            "Total queue wait of dispatched requests by band and fairness ID (divide by "
            'extproc_flow_requests{outcome="dispatched"} for the mean).',
            labels=("priority", "fairness_id"),
        ),
        "wait_max": Stat(
            "extproc_flow_wait_max_seconds",
            "Longest queue wait of a dispatched request since start, by band.",
            "gauge",
            labels=("priority",),
        ),
    },
    {
        # Equal to the dispatched outcome count of extproc_flow_requests.
        "wait_count": 'extproc_flow_requests{outcome="dispatched"}',
        # Bookkeeping of which fairness IDs get their own label (cardinality bound).
        "flows": "label bookkeeping, not a measurement",
    },
)

SHARED_FLOW = StatsFamilies(
    "extproc.flowcontrol.shared.SharedFlowStats",
    {
        "exchanges": Stat(
            "extproc_flow_shared_exchanges", "Successful flow-state exchanges with Redis."
        ),
        "errors": Stat("extproc_flow_shared_errors", "Failed flow-state exchanges with Redis."),
        "peers": Stat(
            "extproc_flow_shared_peers", "Other replicas seen at the last exchange.", "gauge"
        ),
        "bad_entries": Stat(
            "extproc_flow_shared_bad_entries",
            "Peers' flow-state entries skipped: undecodable or implausible figures (another "
            "version, a forged writer); that peer is not counted.",
        ),
        "arrivals_short": Stat(
            "extproc_flow_shared_arrivals_short",
            "Exchanges that published fewer of this replica's higher-band arrivals than there "
            "were (the peers' reserve spike terms count fewer of them).",
        ),
    },
)

LATENCY_MODEL = StatsFamilies(
    "extproc.latency.model.ModelStats",
    {
        "predictions_warm": Stat(
            "extproc_latency_predictions",
            "Latency predictions by source: own (the endpoint's fit), fleet (borrowed, too "
            "few samples), none (nothing learned yet).",
            labels=("source",),
            values=("own",),
        ),
        "predictions_borrowed": Stat(
            "extproc_latency_predictions", "", labels=("source",), values=("fleet",)
        ),
        "predictions_missing": Stat(
            "extproc_latency_predictions", "", labels=("source",), values=("none",)
        ),
        "samples": Stat(
            "extproc_latency_samples", "Scrape intervals the latency model learned from."
        ),
        "resets": Stat(
            "extproc_latency_resets",
            "Engine restarts seen by the latency model (its counters began again).",
        ),
        "reopened": Stat(
            "extproc_latency_refits",
            "Endpoint fits reopened because the server's speed changed.",
        ),
        "rescaled": Stat(
            "extproc_latency_token_rescales",
            "Token scale taken whole (not blended) because the picker's estimates changed.",
        ),
        "rescaled_speed": Stat(
            "extproc_latency_speed_rescales",
            "Reopened fits scaled at once by one whole prefill far off them (a sudden "
            "slowdown shows before the fit re-learns).",
        ),
        "late_heads": Stat(
            "extproc_latency_late_head_predictions",
            "Predictions priced at the speed a late unfinished placement shows "
            "(the endpoint slowed since its fit).",
        ),
        "decode_priced": Stat(
            "extproc_latency_decode_slowdown_predictions",
            "Predictions priced at the slowdown the endpoint's decode steps show "
            "(model decodeSlowdown).",
        ),
    },
)

FILE_WATCH = StatsFamilies(
    "extproc.endpoints.filewatch.FileWatchStats",
    {
        "failures": Stat(
            "extproc_endpoints_file_failures",
            "Passes that found the endpoints file (--endpoints-file) missing, unreadable or "
            "invalid: the last good set of endpoints stays (logged).",
        ),
    },
)

DRAIN = StatsFamilies(
    "extproc.server.drain.DrainStats",
    {
        "cut": Stat(
            "extproc_drain_cut_streams",
            "Ext_proc streams still open when a SIGTERM drain's bound ended (server.grace_s, "
            "or server.response_grace_s while a response body streams through the picker), "
            "by phase: the proxy resets their responses. Logged in one line.",
            labels=("phase",),
            keys=("response_body", "before_response_body", "no_response_body"),
        ),
        "extended": Stat(
            "extproc_drain_extended",
            "SIGTERM drains that waited past server.grace_s (up to server.response_grace_s) "
            "because a response body was streaming through the picker.",
        ),
    },
)

LOOPS = StatsFamilies(
    "extproc.server.lifecycle.LoopStats",
    {
        "crashes": Stat(
            "extproc_background_loop_crashes",
            "Background loops (scrapes, KV events, sharing, discovery, ...) that ended in an "
            "exception: logged with the traceback, started again after a backoff (1 s "
            "doubled per crash in a row, at most 60 s).",
            labels=("loop",),
        ),
    },
)

LOOP_WATCH = StatsFamilies(
    "extproc.server.watchdog.WatchdogStats",
    {
        "stalls": Stat(
            "extproc_loop_stalls",
            "Times the serving event loop went server.loop_stall_s or longer without turning "
            "(every open stream waited meanwhile): logged with the loop's stack. A stall "
            "reaching server.loop_stall_exit_s ends the process (exit code 70) instead.",
        ),
        "longest_s": Stat(
            "extproc_loop_stall_longest_seconds",
            "The longest such stall of this process so far.",
            kind="gauge",
        ),
    },
)

# Every stats class of the package and its table; tests/server/test_families.py checks
# that no stats dataclass is missing here.
TABLES: tuple[StatsFamilies, ...] = (
    ROUTER, INDEX, KV_EVENTS, SCRAPE, DCGM, REQUEST_ENDS, SHARED_REQUEST_ENDS, SHARED_INFLIGHT,
    INFLIGHT_PUSH, SHARED_SESSIONS, SESSION_BOUND, SHARED_GROWTH, SHARED_OBSERVATIONS,
    SHARED_PLACEMENTS, SHARED_SCRAPES, SHARED_CALIBRATION, SHARED_SILENCE, CALIBRATION,
    CAPACITY, PLACED, WATCH, API_SERVER, FLOW, SHARED_FLOW, LATENCY_MODEL, FILE_WATCH, LOOPS, DRAIN,
    LOOP_WATCH,
)  # fmt: skip


def one(name: str, doc: str, value: float, kind: Literal["counter", "gauge"] = "gauge") -> Metric:
    """A family with a single unlabelled sample (figures that are no stats field)."""
    family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, doc)
    family.add_metric([], value)
    return family


def chain(*groups: Iterable[Metric]) -> Iterator[Metric]:
    for group in groups:
        yield from group
