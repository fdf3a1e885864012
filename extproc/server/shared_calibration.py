"""Approximate-mode calibration pooled by the picker replicas behind one gateway, through
Redis: every replica's placements count in every replica's calibration windows, a replica's
confirmed bytes-per-token is adopted by the others, and a replica that starts later reads the
fleet's current value from a Redis key, so it starts calibrated.

Each replica calibrates bytes-per-token (extproc/calibration.py) by pairing the requests it
placed on a server with what the server's engine counted. With three replicas each places a
third of the requests, so its windows fill three times slower: on the tenants workload (24
req/s, bench/RESULTS.md, issue 14, eighth session) 18-26 of 22-30 "index credited chosen,
engine had evicted" misses fell in the run's first 5 s, decided at the uncalibrated 4 bytes
per token where the simulator's tokenizer is ~1. Pooled, each replica's windows hold every
replica's placements: the fleet calibrates as early as one replica would. The KV-capacity
model (index/capacity.py, real tokens per estimated token, which sizes what the index may
credit each server with) is fed the same placements: measured on a third of them it stayed
at its 1.0 prior for ~4 s, crediting every server with ~3x its cache at 4 bytes per token,
and that, not the token estimate itself, made the "credited chosen, engine evicted" misses
(bench/RESULTS.md, issue 14, tenth session).

On with `state.shared_calibration: true` and a (non-Cluster) Redis index. The hot path never
touches Redis: a placement is counted locally and queued on a batched pub/sub channel
(redis_broadcast.py, `extproc:calibration`). A confirmed change is announced on the channel
and written to the key `extproc:calibration` (msgpack `[bytes_per_token,
key_bytes_per_token]`, a day's expiry refreshed by each change); peers adopt it through
`Calibration.adopt`, which refuses (logs, counts) values out of bounds or made for another
key geometry, and never announce what they adopted. Calibration pairs a request with the
engine's count at its end, completed ones only, where the replica holding it learns its end
(extproc/calibration.py): such a placement is said as waiting for its end, and said again
once it completed (its estimate and age, never for a cut one), when the peers pair it too.
Peers' items naming a server outside the pool or carrying implausible numbers are counted
as bad entries and skipped.
Redis down: each replica calibrates from its own placements, says so in a log line, counts
failures and shows `extproc_shared_calibration_degraded` 1 until Redis answers again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.exceptions import RedisError

from extproc.calibration import Calibration
from extproc.redis_broadcast import Broadcast, ChannelCounts, SharedOverBroadcast
from extproc.redis_loop import Outage, close, command

log = logging.getLogger(__name__)

# Item kinds on the channel: a placement (server, estimated tokens, bytes per token, media
# tokens of them, whether it joins calibration's pairing at its end), a completed request of
# those (server, estimated tokens, bytes per token, media tokens, milliseconds since its
# placement) and a confirmed change (bytes per token, key bytes per token).
_PLACED, _COMPLETED, _CHANGED = "e", "d", "c"
# A peer's placement estimate above this many tokens is not a prompt (a forged message).
_MAX_TOKENS = 10_000_000
# A completed request older than this was forgotten by its replica long before (calibration
# waits 600 s for an end): a forged message.
_MAX_AGE_MS = 3_600_000
_KEY_TTL_S = 86_400
_TIMEOUT_S = 2.0
_MAX_BACKOFF_S = 2.0


@dataclass(slots=True)
class SharedCalibrationStats(ChannelCounts):
    """Counters since start: the channel's (items are placements, completed requests and
    changes; `errors` include the fleet's value key's, `bad_entries` undecodable or
    implausible items), peers' placements `applied` to the windows here, peers' completed
    requests (`completed`) handed to the pairing here, peers' changes `adopted` here
    (current value read at start included; equal values count too). Refused values are in
    the calibration's own `refused`."""

    applied: int = 0
    completed: int = 0
    adopted: int = 0


def _count(value: Any, lo: int, hi: int) -> int:
    if type(value) is not int or not lo <= value <= hi:
        raise ValueError(f"not an integer in [{lo}, {hi}]: {value!r}")
    return value


class SharedCalibration(SharedOverBroadcast[SharedCalibrationStats]):
    """Shares `calibration`'s placements and confirmed changes with the peer replicas and
    applies theirs. `known` tells servers of the pool (a peer's item naming another one is
    refused: it must not grow the windows here without bound)."""

    def __init__(
        self,
        client: Redis,
        calibration: Calibration,
        *,
        process_id: str,
        known: Callable[[str], bool] = lambda address: True,
        channel: str = "extproc:calibration",
        key: str = "extproc:calibration",
        interval_s: float = 0.05,
    ) -> None:
        self._client = client
        self._cal = calibration
        self._known = known
        self._key = key
        self._id = process_id
        # This replica's last confirmed change, not yet written to the key.
        self._unwritten: tuple[int, int] | None = None
        self._wake = asyncio.Event()
        self._abandoned: set[asyncio.Task[Any]] = set()  # key calls left to end (stop)
        broadcast = Broadcast(
            client,
            channel,
            self._apply,
            process_id=process_id,
            name="shared calibration",
            logger=log,
            failed_msg="shared calibration: Redis failing (%r); approximate keys calibrate "
            "from this replica's placements only until Redis answers",
            healed_msg="shared calibration: Redis answers again after %d failed exchanges",
            interval_s=interval_s,
        )
        super().__init__(SharedCalibrationStats(), broadcast)
        self._outage = Outage(
            log,
            failed_msg="shared calibration: the fleet's value is not read or written (%r); "
            "retrying",
            healed_msg="shared calibration: the fleet's value key answers again after %d "
            "failed exchanges",
            base_s=interval_s,
            cap_s=_MAX_BACKOFF_S,
        )
        calibration.on_placed = self._placed
        calibration.on_completed = self._completed
        calibration.on_change = self._changed

    @property
    def is_degraded(self) -> bool:
        return super().is_degraded or self._outage.degraded

    async def run(self) -> None:
        await asyncio.gather(super().run(), self._key_loop())

    async def aclose(self) -> None:
        await super().aclose()
        await close(self._client, "shared calibration", self._abandoned)

    def _placed(
        self, endpoint: str, tokens: int, bytes_per_token: int, media: int, at_end: bool
    ) -> None:
        self._channel.send((_PLACED, endpoint, tokens, bytes_per_token, media, at_end))

    def _completed(
        self, endpoint: str, tokens: int, bytes_per_token: int, media: int, age_s: float
    ) -> None:
        age_ms = min(max(round(age_s * 1000), 0), _MAX_AGE_MS)
        self._channel.send((_COMPLETED, endpoint, tokens, bytes_per_token, media, age_ms))

    def _changed(self, bytes_per_token: int, key_bytes_per_token: int) -> None:
        self._channel.send((_CHANGED, bytes_per_token, key_bytes_per_token))
        self._unwritten = (bytes_per_token, key_bytes_per_token)
        self._wake.set()

    def _apply(self, item: Any) -> None:
        # A ValueError/TypeError here is counted as a bad entry by the channel.
        kind, *rest = item
        if kind == _PLACED:
            # Replicas of the versions before media were sent apart (3 fields) and before
            # completed requests were told (4): their placements join the pairing now.
            if len(rest) == 3:
                rest = [*rest, 0]
            endpoint, tokens, bpt, media, at_end = rest if len(rest) == 5 else (*rest, False)
            if type(at_end) is not bool:
                raise ValueError(f"not a boolean: {at_end!r}")
            tokens, bpt, media = self._estimate(endpoint, tokens, bpt, media)
            self._cal.peer_placed(endpoint, tokens, bpt, media, at_end=at_end)
            self._counts.applied += 1
        elif kind == _COMPLETED:
            endpoint, tokens, bpt, media, age_ms = rest
            tokens, bpt, media = self._estimate(endpoint, tokens, bpt, media)
            age_s = _count(age_ms, 0, _MAX_AGE_MS) / 1000
            self._cal.peer_completed(endpoint, tokens, bpt, media, age_s)
            self._counts.completed += 1
        elif kind == _CHANGED:
            bpt, key = rest
            self._adopt(_count(bpt, 0, 2**31), _count(key, 0, 2**31), "a peer replica")
        else:
            raise ValueError(f"unknown item kind {kind!r}")

    def _estimate(self, endpoint: Any, tokens: Any, bpt: Any, media: Any) -> tuple[int, int, int]:
        """A peer's estimate checked: a server of the pool, plausible numbers."""
        if not isinstance(endpoint, str) or not self._known(endpoint):
            raise ValueError(f"not a server of the pool: {endpoint!r}")
        tokens = _count(tokens, 0, _MAX_TOKENS)
        return tokens, _count(bpt, 1, 64), _count(media, 0, tokens)

    def _adopt(self, bpt: int, key: int, source: str) -> None:
        if self._cal.adopt(bpt, key, source=source):
            self._counts.adopted += 1

    async def _key_loop(self) -> None:
        """Reads the fleet's value once at start (until Redis answers), then writes each of
        this replica's confirmed changes."""
        delay = await self._exchange(self._read_key())
        while delay is not None:
            await asyncio.sleep(delay)
            delay = await self._exchange(self._read_key())
        while True:
            await self._wake.wait()
            self._wake.clear()
            while (value := self._unwritten) is not None:
                blob = msgspec.msgpack.encode(list(value))
                delay = await self._exchange(self._client.set(self._key, blob, ex=_KEY_TTL_S))
                if delay is None:
                    if self._unwritten == value:
                        self._unwritten = None
                else:
                    await asyncio.sleep(delay)

    async def _read_key(self) -> None:
        raw = await self._client.get(self._key)
        if raw is None:
            return
        try:
            if not isinstance(raw, bytes):  # the client does not decode responses
                raise TypeError(f"not bytes: {type(raw).__name__}")
            bpt, key = msgspec.msgpack.decode(raw)
            bpt, key = _count(bpt, 0, 2**31), _count(key, 0, 2**31)
        except (ValueError, TypeError):
            self._counts.bad_entries += 1
            log.warning("shared calibration: the fleet's value in %s does not decode", self._key)
            return
        log.info("shared calibration: the fleet's value at start: %d bytes per token", bpt)
        self._adopt(bpt, key, f"the fleet's value in {self._key}")

    async def _exchange(self, call: Any) -> float | None:
        """One Redis call: None when it went through, else how long to back off."""
        try:
            await command(call, _TIMEOUT_S, self._abandoned)
        except (RedisError, OSError, TimeoutError) as exc:
            self._counts.errors += 1
            return self._outage.failed(exc, "key")
        self._outage.healed("key")
        return None
