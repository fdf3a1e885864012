"""Flow-control state shared by active-active replicas through Redis (no leader).

Each picker process publishes, every `share_interval_s`, its highest queued band and the
tokens it served per flow (decayed), and reads everyone else's. With that, each replica:
- holds its lower-band work while any replica has higher-band work queued (strict priority
  fleet-wide: low priority is shed before high wherever it arrived);
- picks flows by fleet-wide served tokens (`weighted-token-fairness-policy`), so token
  shares hold across replicas;
- counts the work other replicas released but the detector cannot see yet (their pending
  figures), so replicas do not each fill the same free capacity;
- with the prefill gate's fleet view (`prefill-gate` `fleetView`), counts the peers'
  placements not yet seen to finish their prefill with their own sizes and ages
  (flowcontrol/prefill_gate.py);
- with `reserve_refill_s`, counts the room the peers' requests free per server with its
  own (flowcontrol/refill.py);
- with `waiting_claims_room`, counts the room the peers' waiting higher-band requests
  claim as placed (flowcontrol/claims.py);
- with `reserve_spike_s`, sizes the reserve's spike term from the fleet's arrivals: each
  publishes its own of the bands above the lowest (the last three intervals', times on
  Redis's clock, which the exchange script returns) and counts the peers' as its own
  (flowcontrol/reserve.py);
- knows which flows are queued where, per band: when the flow next by fleet-wide usage is
  queued only at another replica, free capacity is left to that replica (for at most two
  exchange intervals, so stale state never idles capacity for long). Token shares then hold
  however Envoy spreads a tenant's requests over the replicas.
Saturation is fleet-wide by construction when in-flight counts are shared
(`state.shared_inflight`) or scraped from the servers.

Layout (one hash slot, Cluster-safe): `{<ns>}:flow` hash, field = process id, value =
msgpack `[expiry_ms, top_band | false, {flow: tokens}, pending_requests, pending_tokens,
{band: [queued flow, ...]}, {address: [[age_ms, prompt_tokens], ...]}, {address:
freed_tokens_per_s}, {address: claimed_tokens}, [process id, [[sequence, band,
redis_ms, tokens], ...]]]` (the last five absent from older replicas; the placements empty
without the gate's fleet view, the freed rates empty or absent without `reserve_refill_s`,
the claims absent or empty without `waiting_claims_room`, the arrivals absent without
`reserve_spike_s`);
one script refreshes our field, drops expired ones (Redis server time, so no clock agreement
needed) and returns Redis's time (ms) and the rest.
Redis failing -> per-replica flow control: peers' state is forgotten, a warning is logged,
`errors` counts and `degraded` says so (the `extproc_flow_shared_degraded` gauge). A peer's
entry that does not decode or holds implausible figures (another version, a stray or forged
writer) is skipped: `bad_entries` counts it and a rate-limited warning says so.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass
from typing import Any

from msgspec import msgpack
from redis.exceptions import NoScriptError, RedisError

from extproc.endpoints.shared_inflight import default_process_id
from extproc.flowcontrol.controller import FlowController
from extproc.flowcontrol.reserve import OWN_KEPT, Reserve
from extproc.redis_client import redis_from_url
from extproc.redis_loop import Outage, close, command
from extproc.throttle import Throttle

log = logging.getLogger("extproc.flowcontrol")

# A peer's rate of room freed on one server above this (tokens per second) is not a server's
# (a forged or corrupt entry): its rates are dropped and it is not counted as a peer, as an
# undecodable entry. Unbounded, one such rate would let every replica's reserve be credited
# away.
_MAX_FREED_RATE = 10_000_000.0

# A peer's claim on one server above this many tokens is no waiting request's (forged or
# corrupt): its entry is dropped, as one with an implausible freed rate.
_MAX_CLAIM = 10_000_000

_EXCHANGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local own = cmsgpack.unpack(ARGV[2])
own[1] = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], cmsgpack.pack(own))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) * 4)
local all = redis.call('HGETALL', KEYS[1])
local out = {now}
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] then
    local v = cmsgpack.unpack(all[i + 1])
    if v[1] < now then redis.call('HDEL', KEYS[1], all[i]) else out[#out + 1] = all[i + 1] end
  end
end
return out
"""


@dataclass(slots=True)
class SharedFlowStats:
    """Counters since start: successful and failed exchanges, peers' entries skipped as
    undecodable or implausible (`bad_entries`); `peers` seen at the last exchange;
    exchanges that published fewer of our arrivals than there were (`arrivals_short`)."""

    exchanges: int = 0
    errors: int = 0
    peers: int = 0
    bad_entries: int = 0
    arrivals_short: int = 0


class SharedFlowState:
    def __init__(
        self,
        client: Any,
        controller: FlowController,
        *,
        namespace: str = "extproc",
        interval_s: float = 0.1,
        ttl_s: float | None = None,
        process_id: str | None = None,
    ) -> None:
        self._client = client
        self._fc = controller
        self._key = f"{{{namespace}}}:flow"
        self.interval_s = interval_s
        self._ttl_ms = int((ttl_s or max(1.0, 10 * interval_s)) * 1000)
        self.process_id = process_id or default_process_id()
        self.stats = SharedFlowStats()
        self._throttle = Throttle()  # a corrupt entry is met at every exchange until it expires
        self._outage = Outage(
            log,
            failed_msg="flow control: Redis unreachable, per replica until it returns: %r",
            healed_msg="flow control: shared state restored (after %d failed exchanges)",
        )
        # Each exchange is bounded: a Redis that hangs counts as down, as one that refuses.
        # 2 s is what the client's own timeouts allow (0.5 s connect + 0.5 s read, retried once).
        self._timeout_s = max(2.0, 10 * interval_s)
        self._sha: str | None = None
        self._abandoned: set[asyncio.Task[Any]] = set()  # Redis calls left to end (stop)
        # With the reserve's spike term: Redis's clock less ours (ms) at the last exchange
        # (arrival times travel on Redis's clock), and each peer's last arrival taken.
        self._offset_ms: float | None = None
        self._arrivals_taken: dict[str, int] = {}
        controller.defer_limit_s = 2 * interval_s

    @classmethod
    def from_url(cls, url: str, controller: FlowController, *, cluster: bool = False, **kw: Any):
        client = redis_from_url(url, cluster=cluster, connect_timeout_s=0.5, timeout_s=0.5)
        return cls(client, controller, **kw)

    @property
    def degraded(self) -> bool:
        """The last exchange failed: flow control is per replica."""
        return self._outage.degraded

    async def exchange(self) -> None:
        """One publish-and-read; on failure, fall back to local state (never raises)."""
        fc = self._fc
        mine = {k: round(v) for k, v in fc.served.items()}
        # No queued band is `false`, not nil: a nil inside the array would cut it short when
        # the Lua script re-packs it (and peers would drop the entry as corrupt).
        own_top = fc.top_band()
        fields = [0, False if own_top is None else own_top, mine, fc.pending_requests,
                  fc.pending_tokens, fc.top_flows()]  # fmt: skip
        gate = fc.gate if fc.gate is not None and fc.gate.fleet_view else None
        refill = fc.refill
        claims = fc.claims
        if gate is not None or refill is not None or claims is not None:
            fields.append(gate.published() if gate is not None else {})
        if refill is not None or claims is not None:
            rates = refill.rates() if refill is not None else {}
            fields.append({a: round(r, 1) for a, r in rates.items()})
        if claims is not None:
            fields.append(claims.published())
        spike = fc.reserve if fc.reserve_count and fc.reserve.spike_s else None
        if spike is not None:
            fields.extend({} for _ in range(9 - len(fields)))  # the fields before, if absent
            fields.append([self.process_id, self._own_arrivals(spike, fc)])
        own = msgpack.encode(fields)
        try:
            sent = spike.now() if spike is not None else 0.0
            now_ms, *blobs = await command(self._eval(own), self._timeout_s, self._abandoned)
            if spike is not None:
                self._offset_ms = int(now_ms) - (sent + spike.now()) / 2 * 1000
        except (RedisError, OSError, TimeoutError) as exc:
            self.stats.errors += 1
            self._outage.failed(exc)  # no backoff: the exchange keeps its interval
            fc.peer_top_band = None
            fc.peer_served = {}
            fc.peer_pending = (0, 0)
            fc.peer_flows = {}
            if gate is not None:
                gate.peers_lost()
            if refill is not None:
                refill.peer_rates = {}
            if claims is not None:
                claims.peers_seen([])
            return
        self._outage.healed()
        self.stats.exchanges += 1
        top: int | None = None
        served: dict[str, float] = {}
        peers = 0
        pend_reqs = pend_toks = 0
        queued: dict[int, set[str]] = {}
        placed: dict[str, list[tuple[float, int]]] = {}  # address -> (age s, tokens)
        freed: dict[str, float] = {}  # address -> tokens/s the peers' requests freed
        claimed: list[tuple[int, dict[str, int]]] = []  # per peer: (its top band, its claims)
        arrived: dict[str, list[tuple[int, int, int, int]]] = {}  # peer -> its arrivals
        for blob in blobs:
            try:
                _, band, flows, p_reqs, p_toks, *rest = msgpack.decode(blob)
                # Redis's Lua msgpack re-packs an empty map as an empty array.
                for f, v in _mapping(flows).items():
                    served[str(f)] = served.get(str(f), 0.0) + float(v)
                pend_reqs += max(0, int(p_reqs))
                pend_toks += max(0, int(p_toks))
                for b, names in _mapping(rest[0] if rest else {}).items():
                    queued.setdefault(int(b), set()).update(str(n) for n in names)
                theirs = {
                    str(a): [(int(age) / 1000, int(t)) for age, t in items]
                    for a, items in _mapping(rest[1] if gate and len(rest) > 1 else {}).items()
                }
                for a, items in theirs.items():
                    placed.setdefault(a, []).extend(items)
                rates = _mapping(rest[2] if refill is not None and len(rest) > 2 else {})
                for a, r in rates.items():
                    freed[str(a)] = freed.get(str(a), 0.0) + _freed_rate(r)
                if claims is not None and len(rest) > 3 and type(band) is int:
                    theirs_claimed = {str(a): _claimed(t) for a, t in _mapping(rest[3]).items()}
                    claimed.append((band, theirs_claimed))
                if spike is not None and len(rest) > 4:
                    peer, items = rest[4]
                    arrived[str(peer)] = [_arrival(a) for a in items]
            except (ValueError, TypeError, AttributeError) as exc:  # DecodeError: a ValueError
                # A foreign or corrupt entry must not stop flow control: skipped, said.
                self.stats.bad_entries += 1
                self._throttle.warn(
                    log, "bad entry", "flow control: a peer's shared entry skipped (%r)", exc
                )
                continue
            peers += 1
            if type(band) is int and (top is None or band > top):
                top = band
        self.stats.peers = peers
        fc.peer_top_band = top
        fc.peer_served = served
        fc.peer_pending = (pend_reqs, pend_toks)
        fc.peer_flows = {b: frozenset(names) for b, names in queued.items()}
        if gate is not None:
            gate.peers_placed(placed)
        if refill is not None:
            refill.peer_rates = freed
        if claims is not None:
            claims.peers_seen(claimed)
        if spike is not None:
            self._peers_arrived(spike, arrived)
        # A peer's higher band may have drained: whatever we hold may now go.
        fc.dispatch()

    def _own_arrivals(self, reserve: Reserve, fc: FlowController) -> list[list[int]]:
        """Our arrivals of the last three exchange intervals (each peer reads at least one
        exchange of ours in that time), bands above the lowest only (nothing is reserved
        for it), times on Redis's clock: `[sequence number, band, ms, tokens]`."""
        if self._offset_ms is None:  # Redis's clock not read yet: next time
            return []
        lowest = fc.lowest_band()
        if lowest is None:
            return []
        mine, short = reserve.own_arrivals(reserve.now() - 3 * self.interval_s, lowest)
        if short:
            self.stats.arrivals_short += 1
            self._throttle.warn(
                log,
                "arrivals short",
                "flow control: more arrivals of a band than %d in %.1f s; the peers' reserve "
                "spike terms count fewer of ours",
                OWN_KEPT,
                3 * self.interval_s,
            )
        offset = self._offset_ms
        return [[seq, band, round(at * 1000 + offset), tokens] for seq, band, at, tokens in mine]

    def _peers_arrived(
        self, reserve: Reserve, arrived: dict[str, list[tuple[int, int, int, int]]]
    ) -> None:
        """The peers' arrivals not taken yet go into the reserve's spike terms."""
        assert self._offset_ms is not None
        taken: dict[str, int] = {}
        for peer, items in arrived.items():
            last = self._arrivals_taken.get(peer, 0)
            if items and max(seq for seq, *_ in items) < last:
                last = 0  # numbered from 1 again: the peer restarted under the same id
            for seq, band, at_ms, tokens in items:
                if seq > last and not reserve.peer_arrived(
                    band, (at_ms - self._offset_ms) / 1000, tokens
                ):
                    self.stats.bad_entries += 1  # a band past any deployment's count
            taken[peer] = max([last, *(seq for seq, *_ in items)])
        self._arrivals_taken = taken  # peers gone are forgotten

    async def _eval(self, own: bytes) -> list[bytes]:
        args = (self._key, self.process_id, own, str(self._ttl_ms))
        if self._sha is None:
            self._sha = await self._client.script_load(_EXCHANGE)
        try:
            return await self._client.evalsha(self._sha, 1, *args)
        except NoScriptError:
            return await self._client.eval(_EXCHANGE, 1, *args)

    async def run(self) -> None:
        while True:
            await self.exchange()
            await asyncio.sleep(self.interval_s)

    async def aclose(self) -> None:
        """Withdraw our entry so peers stop deferring to it, then close the client."""
        try:
            hdel = self._client.hdel(self._key, self.process_id)
            await command(hdel, self._timeout_s, self._abandoned)
        except (RedisError, OSError, TimeoutError) as exc:
            log.info("flow control: could not withdraw shared state (%r); its TTL will", exc)
        await close(self._client, "flow control", self._abandoned)


def _freed_rate(value: Any) -> float:
    rate = float(value)
    if not (math.isfinite(rate) and 0.0 <= rate <= _MAX_FREED_RATE):
        raise ValueError(f"implausible freed rate {value!r}")
    return rate


def _claimed(value: Any) -> int:
    # Claims are published as whole tokens: anything else (a float, inf, a bool) is no
    # replica's; `int()` of it could also raise past the caller's except (OverflowError).
    if type(value) is not int or not 0 < value <= _MAX_CLAIM:
        raise ValueError(f"implausible claim {value!r}")
    return value


def _arrival(value: Any) -> tuple[int, int, int, int]:
    """A peer's arrival: whole numbers, a plausible size (as a claim's)."""
    seq, band, at_ms, tokens = value
    if not all(type(v) is int for v in value) or not 0 < tokens <= _MAX_CLAIM or seq <= 0:
        raise ValueError(f"implausible arrival {value!r}")
    return seq, band, at_ms, tokens


def _mapping(value: Any) -> dict:
    """A decoded msgpack map; an empty array (how Lua re-packs an empty map) is an empty map."""
    if isinstance(value, list) and not value:
        return {}
    if not isinstance(value, dict):
        raise TypeError("not a map")
    return value
