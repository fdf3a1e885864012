"""Approximate mode tuned by what the engines report: their real KV block size and how many
characters a token of their tokenizer really covers.

Approximate keys hash `block_tokens x bytes_per_token` bytes of canonical prompt text per
block. With the defaults (64 x 4) a block is ~64 estimated tokens, while vLLM caches blocks
of its configured size (16, 32, ...) of real tokens: the prediction is off by the ratio of
the two. `Calibration` owns the parse settings the router parses with and adjusts them:

- `block_tokens` follows the block size the endpoints publish in `vllm:cache_config_info`
  (the smallest, when they disagree);
- `bytes_per_token` follows the ratio of the prompt tokens an endpoint's engine counted per
  request (`vllm:request_prompt_tokens` sum over count) to our mean estimate per request
  placed there meanwhile, once enough tokens are observed. Per request, not in total: with
  several picker replicas behind one gateway each places a share of an engine's requests,
  and the totals' ratio (our estimates against `vllm:prompt_tokens_total`, all of it) read
  that share as characters per token: three replicas each saw ~3x their estimates, outside
  the bounds, skipped every window and kept 4 bytes per token where one replica learned 1
  (issue 14, seventh session). Engines without the histogram fall back to the totals; there
  foreign traffic on the same engine shows as a ratio out of bounds and that window is
  skipped.

A change of block size changes the keys (block boundaries move, the index's old entries stop
matching and expire); it comes once, from the first scrape, before most traffic. A change of
bytes-per-token does not: the first one pins the key geometry (`key_bytes_per_token`, the
value the keys were made with), so block boundaries stay where they were and only the token
estimates (hence the tokens a block stands for, and capacity accounting) change. Before that,
each change re-keyed every approximate prefix and the demo's approximate mode forgot what it
had learned 4-7 times a run. Changes are still rare by design: a window
pairs our placements with the engine's counter, and the two are never aligned (requests in
flight are counted on one side only): with windows of one or two long prompts the measured
ratio swung 4x, and bytes-per-token flipped 1 <-> 4 a dozen times per run. So a window must
hold many requests and tokens, a new value must be clearly away from the current one
(hysteresis: a true 2.5 characters per token does not alternate 2 and 3), and two windows
in a row must propose it. Every change is logged and counted. Event-loop use only.

A window compares the same requests on both sides where it can: the engine counts a
request when it finishes it (vLLM, and the simulator, which counted at admission before the
thirty-first session), and under load that is
seconds after we placed it, so "placed since the last scrape" and "counted since the last
scrape" are different requests. While prompts grow (conversations getting longer), the
counted ones are the older, shorter ones, and the ratio of the two sets' means reads too
few real tokens per estimate: on the tenants workload at the knee, three pooled replicas
read ~2 characters per token where the simulator's tokenizer is ~1.3 (a bias of only 15%
crosses the rounding edge at 1.5), confirmed it twice and the whole fleet adopted it; the
hysteresis (0.75 then) kept 2 for the rest of the run (issue 14, fourteenth session). So
each endpoint's placements wait in a queue, oldest first, and each request the engine's
histogram counts is paired with the oldest one: the window's ratio is the engine's prompt
tokens over our estimates of the same requests. When the engine counts more requests than
were placed here (foreign traffic, a replica not pooling) the pairing is lost for that
window and it falls back to the per-request means (a peer's placement the engine counted
before it arrived here is paired when it arrives). Such an engine's window closes on 8
requests counted, never on the totals: closed on fewer, under load, it compared all placed
with the few admitted and read 0.54x. The hysteresis is 0.6: a value clearly
past the rounding edge from the current one (a true 2.5 still keeps 2 or 3, a true 1.3
leaves a wrongly learned 2).

Only the text part of an estimate measures characters per token: media (images, video,
audio) are priced from their size by the model's estimator and do not change with
bytes-per-token, so each placement's media tokens are kept apart and taken off the engine's
count before the ratio (read as text they pulled it toward the current value: multimodal
prompts whose images were priced right kept 2 where the text said 1.28, issue 14,
twenty-third session). `stats.ratios` stays the whole prompt's engine tokens per estimate.

The engine's per-request histogram counts a request at its finish (vLLM, and the simulator
since it counts as vLLM 0.32 does), and never one that was cut (the client hung up, or this
picker's eviction reset it). Pairing in placement order then went wrong two ways: short
requests finishing before long ones placed earlier paired with the wrong placements, and
every cut left its placement at the head of the queue, shifting every later pair by one
(20-66 such placements per server by a run's end; characters per token read 1.32 +- 0.22
against a true 1.28, and bytes-per-token flipped 1 -> 2 mid-burst on one run, issue 15,
thirty-first session). So where the picker learns each request's end (`state.request_end`
holding for the access log, the shared ends included), a placement joins the queue at its
end, and only when it completed: its access-log entry came, with a 2xx status and no
response flag saying the response stopped short (`Ended.completed`: a client that hangs up
mid-stream is logged with the 200 already sent, the flag tells it), and flow control did not
evict it. Replayed on those runs, 1.275 +- 0.005. A placement waits for its
end in a bounded map (`_MAX_OPEN`, aged out after `_OPEN_S`: a request whose end never
comes is forgotten, counted in `unended`). Where no end is known (`state.request_end`
`stream`, or `auto` before any access-log entry) placements join at placement, as before.
A placement ended (or a count made) but unpaired for `_STALE_S` is dropped and counted in
`stale`: a leftover (a cut the entry did not tell: an end another replica forwarded
carries no status nor flags; an access-log entry lost) shifts the pairs for that long only,
not for good.

Replicas behind one gateway can pool this (`state.shared_calibration`,
server/shared_calibration.py): each replica's placements count in every replica's windows
(`peer_placed`), so each window fills as fast as one replica's would, and a replica's own
confirmed change (`on_change`) is adopted by the others (`adopt`) through the same logged,
counted path, never re-announced. A peer's placement counts in the window's estimates and
requests (and the KV-capacity model's, `on_peer_placed`) when it is placed, but joins the
pairing queue as the peer's own would: where the peer waits for the request's end (it says
so with the placement), only once it completed, when the peer tells it (`on_completed` ->
`peer_completed`, with its estimate and its age: placed before pairing started here, it is
left out as this replica's own are). A cut one is never told. Until the thirty-second
session the channel carried placements only and every peer's placement joined at placement:
with two replicas half of each queue was in placement order, cuts included, and the drift
pairing at the end had removed came back for the fleet (issue 15). A peer without request
ends (or of a version before) still has its placements join at placement.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import msgspec

from extproc.core import InferenceRequest
from extproc.requests import parse_request
from extproc.requests.parse import estimate_media_tokens
from extproc.requests.settings import ParseSettings
from extproc.throttle import Throttle

log = logging.getLogger("extproc.calibration")

# At least this many engine prompt tokens and placed requests in a window before its ratio
# is trusted: the misalignment of a request or two in flight is then a small part of it.
_MIN_TOKENS = 16_000
_MIN_REQUESTS = 8
# Measured characters per token must be at least this far from the current value to propose
# a change (hysteresis), and the same proposal must come from this many windows in a row.
_HYSTERESIS = 0.6
_CONFIRMATIONS = 2
# Placements waiting to be paired with the engine's count, per endpoint, at most (a queue
# that only grows means the engine never counts them: the pairing is dropped).
_MAX_PENDING = 4096
# Requests the engine counted before their placement reached this replica (a peer's, on the
# batched channel) are paired when it arrives; more than this many is someone else's traffic.
_MAX_DEBT = 8
# Measured characters per token outside these bounds mean someone else's traffic (or, below
# one, a chat template's tokens outweighing short prompts): a token covers at least one byte
# of text, and no tokenizer we know averages more than a dozen. Bounds on the characters, not
# on the ratio to the current value: a ratio bound of 3x refused the simulator's true ~1.3
# characters per token from the default 4 (ratio ~3.1) in about half the runs, and from a
# wrong value a ratio bound can refuse the way back.
_CHARS_PER_TOKEN = (1.0, 12.0)
# Placements waiting for their request's end, at most, and for at most this long (above
# `state.request_end.max_hold_s`' default 330 s: an end released later than that is none).
_MAX_OPEN = 65_536
_OPEN_S = 600.0
# An ended placement the engine has not counted (or a count no ended placement came for)
# within this long is a leftover: dropped, or it would shift every later pair. Several
# scrape intervals and the access log's batching; an engine counts a finished request in
# the very next scrape.
_STALE_S = 5.0


@dataclass(slots=True)
class _Window:
    # Our token estimates of requests placed since the window opened: their text part (in
    # the current bytes-per-token) and their media part (images, video, audio: priced from
    # their size by the model's estimator, not by bytes-per-token).
    estimated: int = 0
    media: int = 0
    requests: int = 0  # how many requests those were
    engine_start: int | None = None  # the engine's prompt-token counter when it opened
    # The engine's per-request prompt-token histogram (sum, count) when it opened; None when
    # the engine does not export it.
    finished_start: tuple[float, float] | None = None
    # Pairing (engines with the histogram): our estimates of the placements the engine has
    # not counted yet, oldest first (None: not paired), the histogram's count at the last
    # scrape, and the estimates of the requests it counted since the window opened (text,
    # media, as above).
    # Each placement: (text, media, when it joined: None for placement order, which waits
    # as long as its request runs).
    pending: deque[tuple[int, int, float | None]] | None = None
    counted: float = 0.0
    paired_estimated: int = 0
    paired_media: int = 0
    # When each request counted before its placement arrived here was counted, oldest first.
    debt: deque[float] = field(default_factory=deque)
    aligned: bool = True  # every request counted in this window was paired
    # When pairing (re)started: a placement made before may have been counted before, so
    # its end does not join the queue.
    opened: float = 0.0


@dataclass(slots=True)
class CalibrationStats:
    block_tokens: int = 0
    bytes_per_token: int = 0
    changes: int = 0
    windows_skipped: int = 0
    # Scrapes of engines that export no prompt-token counter: nothing to measure from them
    # (each such endpoint said once).
    unmeasured: int = 0
    adopted: int = 0  # of `changes`: bytes-per-token values adopted from peer replicas
    refused: int = 0  # peers' values refused (out of bounds, or another key geometry)
    ratios: dict[str, float] = field(default_factory=dict)  # endpoint -> last engine/estimate
    # Pairing at the request's end: placements left out because their request did not
    # complete (evicted, non-2xx, no access-log entry), forgotten waiting for an end that
    # never came, and dropped as stale (see `_STALE_S`; counts unmatched, too).
    cut: int = 0
    unended: int = 0
    stale: int = 0


class Calibration:
    """The parser the router calls (`calibration(path, headers, body)`), with settings that
    follow the engines. `placed()` is told of every placed request; `observe()` of every
    scrape. `approximate_keys=False` (precise mode) parses without approximate keys: the
    router replaces them with the tokenizer's, so computing them would be wasted work."""

    def __init__(
        self,
        settings: ParseSettings,
        *,
        enabled: bool = True,
        approximate_keys: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.enabled = enabled
        self.approximate_keys = approximate_keys
        self._windows: dict[str, _Window] = {}
        # A proposed bytes-per-token and how many windows in a row proposed it.
        self._proposal: tuple[int, int] | None = None
        self.stats = CalibrationStats(settings.key_block_tokens, settings.bytes_per_token)
        # Windows left out are said at most once a minute (with how many were left out in
        # between); before, only a counter showed them, and a fleet whose every window was
        # left out (another client on its engines) kept the default silently.
        self._throttle = Throttle(every_s=60.0)
        self._stale_log = Throttle(every_s=60.0)
        self._unmeasured: set[str] = set()  # endpoints said to export no prompt counter
        # Told the factor every token estimate grows by when bytes-per-token changes (the
        # capacity model measures in those estimates: see extproc/index/capacity.py).
        self.on_units: list[Callable[[float], None]] = []
        # Told (bytes_per_token, key bytes per token) of each change this replica confirmed
        # from its own windows (not of adopted ones: peers never re-announce a value).
        self.on_change: Callable[[int, int], None] | None = None
        # Told (endpoint, estimated tokens, bytes_per_token, media tokens of them, whether it
        # waits for its end to join the pairing queue) of each request placed here (the peers
        # count it in their windows).
        self.on_placed: Callable[[str, int, int, int, bool], None] | None = None
        # Told (endpoint, estimated tokens, bytes_per_token, media tokens of them, seconds
        # since its placement) of each request placed here that completed, once its end is
        # known: where it was told as waiting for its end, the peers pair it then.
        self.on_completed: Callable[[str, int, int, int, float], None] | None = None
        # Told (endpoint, estimated tokens in this replica's unit) of each peer's placement
        # (the KV-capacity model measures from them too).
        self.on_peer_placed: list[Callable[[str, int], None]] = []
        # Whether request ends are known now (`RequestEnds.holding`): placements then wait
        # in `_open` for `ended`. None: never known, placement order.
        self.ends_known: Callable[[], bool] | None = None
        self._clock = clock
        # request id -> (endpoint, text, media, placed at), oldest first.
        self._open: OrderedDict[str, tuple[str, int, int, float]] = OrderedDict()

    def __call__(self, path: str, headers: Mapping[str, str], body: bytes) -> InferenceRequest:
        return parse_request(
            path, headers, body, self.settings, approximate_keys=self.approximate_keys
        )

    def placed(self, endpoint: str, request: InferenceRequest) -> None:
        if self.enabled and request.prompt is not None:
            media = min(estimate_media_tokens(request.prompt), request.prompt_tokens)
            text = request.prompt_tokens - media
            w = self._windows.setdefault(endpoint, _Window())
            w.estimated += text
            w.media += media
            w.requests += 1
            known = self.ends_known
            rid = request.request_id
            at_end = bool(rid) and known is not None and known()
            if at_end:
                now = self._clock()
                self._age_open(now)
                self._open.pop(rid, None)  # a reused id: the later placement counts
                self._open[rid] = (endpoint, text, media, now)
                if len(self._open) > _MAX_OPEN:
                    self._open.popitem(last=False)
                    self.stats.unended += 1
            else:
                _enqueue(w, text, media, None)
            if self.on_placed is not None:
                self.on_placed(
                    endpoint, request.prompt_tokens, self.settings.bytes_per_token, media, at_end
                )

    def peer_placed(
        self,
        endpoint: str,
        tokens: int,
        bytes_per_token: int,
        media: int = 0,
        *,
        at_end: bool = False,
    ) -> None:
        """A peer replica placed a request on `endpoint` it estimated at `tokens` with its
        `bytes_per_token`, `media` of them for its media: counted in this replica's window as
        if placed here (the text part in this replica's unit; the chat template's few tokens
        per turn scale with it too, a small error only while replicas disagree). `at_end`:
        the peer learns the request's end and tells it if it completed (`peer_completed`):
        it joins the pairing queue then, not now."""
        if self.enabled:
            text, media = self._in_units(tokens, bytes_per_token, media)
            w = self._windows.setdefault(endpoint, _Window())
            w.estimated += text
            w.media += media
            w.requests += 1
            if not at_end:
                _enqueue(w, text, media, None)
            for listener in self.on_peer_placed:
                listener(endpoint, text + media)

    def peer_completed(
        self, endpoint: str, tokens: int, bytes_per_token: int, media: int, age_s: float
    ) -> None:
        """A request a peer placed on `endpoint` `age_s` ago (told `at_end`) completed: it
        joins the pairing queue as this replica's own completed requests do (a cut one is
        never told, as the engine never counts it)."""
        if not self.enabled:
            return
        now = self._clock()
        w = self._windows.get(endpoint)
        if w is not None and now - max(age_s, 0.0) >= w.opened:
            _enqueue(w, *self._in_units(tokens, bytes_per_token, media), now)

    def _in_units(self, tokens: int, bytes_per_token: int, media: int) -> tuple[int, int]:
        """A peer's estimate of `tokens` at its `bytes_per_token`, `media` of them for media:
        (text in this replica's unit, media)."""
        media = min(max(media, 0), tokens)
        return round((tokens - media) * bytes_per_token / self.settings.bytes_per_token), media

    def ended(self, request_id: str, completed: bool) -> None:
        """The request `request_id` ended: its placement joins the pairing queue when it
        `completed` (the engine counts it now), and is left out otherwise (the engine never
        counts a cut request). A request placed while no end was known is not waiting."""
        now = self._clock()
        self._age_open(now)
        held = self._open.pop(request_id, None)
        if held is None:
            return
        endpoint, text, media, placed_at = held
        if not completed:
            self.stats.cut += 1
            return
        w = self._windows.get(endpoint)
        if w is not None and placed_at >= w.opened:
            _enqueue(w, text, media, now)
        if self.on_completed is not None:
            bpt = self.settings.bytes_per_token
            self.on_completed(endpoint, text + media, bpt, media, now - placed_at)

    def _age_open(self, now: float) -> None:
        """Forget placements whose end is overdue (counted in `unended`)."""
        open_ = self._open
        while open_:
            placed_at = next(iter(open_.values()))[3]
            if now - placed_at < _OPEN_S:
                break
            open_.popitem(last=False)
            self.stats.unended += 1

    def adopt(self, bytes_per_token: int, key_bytes_per_token: int, *, source: str) -> bool:
        """A peer's confirmed bytes-per-token: adopted when within the bounds and made for
        the same key geometry (the peers' keys are this replica's keys); otherwise counted
        in `refused`, logged, and False. Adopted changes go through the path of this
        replica's own (logged, counted, listeners told), but are not announced again."""
        lo, hi = _CHARS_PER_TOKEN
        bpt, key = bytes_per_token, key_bytes_per_token
        if not self.enabled:
            return False
        if not lo <= bpt <= hi or key != self.settings.key_bpt:
            self.stats.refused += 1
            log.warning(
                "calibration from %s refused: %d bytes per token for keys of %d bytes per "
                "token (bounds %g-%g; this replica's keys: %d)",
                source, bpt, key, lo, hi, self.settings.key_bpt,
            )  # fmt: skip
            return False
        self._proposal = None
        if bpt != self.settings.bytes_per_token:
            self.stats.adopted += 1
            self._set(bytes_per_token=bpt, why=f"adopted from {source}", announce=False)
        return True

    def forget(self, endpoint: str) -> None:
        """`endpoint` left the pool: drop its window and its ratio (a gauge of a server that
        is gone reads as a live one)."""
        self._windows.pop(endpoint, None)
        self.stats.ratios.pop(endpoint, None)
        for rid in [r for r, held in self._open.items() if held[0] == endpoint]:
            del self._open[rid]
        self._unmeasured.discard(endpoint)

    def observe(
        self,
        endpoint: str,
        block_size: int | None,
        prompt_tokens: int | None,
        finished: tuple[float, float] | None = None,
    ) -> None:
        """One scrape of `endpoint`: its engine block size and prompt-token counter, and
        `finished`, the sum and count of its per-request prompt-token histogram (None, or a
        count of 0 before any request finished, when not exported)."""
        if not self.enabled:
            return
        if block_size and block_size != self.settings.block_tokens:
            self._set(block_tokens=block_size, why=f"{endpoint} reports KV blocks of that size")
        if prompt_tokens is None:
            self.stats.unmeasured += 1
            if endpoint not in self._unmeasured:
                self._unmeasured.add(endpoint)
                log.warning(
                    "calibration: %s exports no prompt-token counter (vllm:prompt_tokens_total);"
                    " characters per token are not measured from it",
                    endpoint,
                )
            return
        self._unmeasured.discard(endpoint)
        w = self._windows.setdefault(endpoint, _Window())
        if w.engine_start is None or prompt_tokens < w.engine_start:  # first, or a restart
            w.engine_start, w.estimated, w.media, w.requests = prompt_tokens, 0, 0, 0
            w.finished_start = finished
            # Placements before this scrape may or may not be counted yet: pairing starts
            # with the next one (a picker normally starts before its traffic).
            w.pending = deque() if finished is not None else None
            w.counted = finished[1] if finished is not None else 0.0
            w.paired_estimated = w.paired_media = 0
            w.debt.clear()
            w.aligned = True
            w.opened = self._clock()
            return
        stale = _pair(w, finished, self._clock())
        if stale:
            self.stats.stale += stale
            if self._stale_log.allow("stale") is not None:
                log.warning(
                    "calibration: %d placements or counts of %s left unpaired for %g s were "
                    "dropped (a cut the access log did not tell, a lost access-log entry); "
                    "%d in all",
                    stale, endpoint, _STALE_S, self.stats.stale,
                )  # fmt: skip
        engine = prompt_tokens - w.engine_start
        if engine < _MIN_TOKENS or w.requests < _MIN_REQUESTS:
            return
        estimated, media, requests, start = w.estimated, w.media, w.requests, w.finished_start
        # An engine that counts its requests: the window closes on 8 counted (and, when
        # paired, on every counted request's placement here). Closed on fewer it fell back to
        # the totals, which under load compare everything placed with the little admitted (a
        # queue growing): 0.54x, 2 characters per token read for 1.3.
        if (
            finished is not None
            and start is not None
            and (finished[1] - start[1] < _MIN_REQUESTS or (w.aligned and len(w.debt) > 0))
        ):
            return
        paired = w.aligned and w.pending is not None and w.paired_estimated + w.paired_media > 0
        text, media = (w.paired_estimated, w.paired_media) if paired else (estimated, media)
        w.engine_start, w.estimated, w.media, w.requests = prompt_tokens, 0, 0, 0
        w.finished_start = finished
        w.paired_estimated = w.paired_media = 0
        w.aligned = True
        done = finished[1] - start[1] if finished is not None and start is not None else 0.0
        if done >= _MIN_REQUESTS and paired and finished is not None and start is not None:
            # The engine's prompt tokens against our estimates of the same requests.
            counted = finished[0] - start[0]
        elif done >= _MIN_REQUESTS and finished is not None and start is not None:
            # Per request: the engine's mean prompt against our mean estimate (see above).
            counted = (finished[0] - start[0]) / done * requests
        else:
            counted = float(engine)
        ratio = counted / (text + media) if text + media else 0.0
        # Our text estimate is chars / bytes_per_token; the engine's count less our media
        # estimate says the real characters per token is bytes_per_token / text_ratio. The
        # media part is left out: it does not scale with bytes-per-token, and read as text
        # it pulled the measurement toward the current value (bench_routing's multimodal
        # prompts, 768 of ~2,860 engine tokens in images priced exactly: 1.48 characters per
        # token read for the text's 1.28, inside the hysteresis of 2, so the estimate stayed
        # at 0.74 of the engine's count; issue 14, twenty-third session).
        text_ratio = (counted - media) / text if text > 0 else 0.0
        current = self.settings.bytes_per_token
        measured = current / text_ratio if text_ratio > 0 else float("inf")
        if not _CHARS_PER_TOKEN[0] <= measured <= _CHARS_PER_TOKEN[1]:
            self.stats.windows_skipped += 1
            suppressed = self._throttle.allow("window skipped")
            if suppressed is not None:
                log.warning(
                    "calibration: a window of %s left out: %.2f engine tokens per estimated "
                    "token, %.2f characters per token (outside %g-%g): another client on the "
                    "engine, or prompts shorter than its chat template (%d more left out since "
                    "the last line)",
                    endpoint, ratio, measured, *_CHARS_PER_TOKEN, suppressed,
                )  # fmt: skip
            return
        self.stats.ratios[endpoint] = ratio
        if abs(measured - current) < _HYSTERESIS:
            self._proposal = None
            return
        bpt = max(1, round(measured))
        seen = self._proposal[1] + 1 if self._proposal and self._proposal[0] == bpt else 1
        self._proposal = (bpt, seen)
        if seen >= _CONFIRMATIONS and bpt != current:
            self._proposal = None
            self._set(bytes_per_token=bpt, why=f"{endpoint} counted {ratio:.2f}x our estimate")

    def _set(self, *, why: str, announce: bool = True, **changes: int) -> None:
        old_bpt = self.settings.bytes_per_token
        if "bytes_per_token" in changes and self.settings.key_bytes_per_token is None:
            changes = {**changes, "key_bytes_per_token": old_bpt}
        self.settings = msgspec.structs.replace(self.settings, **changes)
        self.stats.block_tokens = self.settings.key_block_tokens
        self.stats.bytes_per_token = self.settings.bytes_per_token
        self.stats.changes += 1
        log.info("approximate keys recalibrated: %s (%s)", changes, why)
        new_bpt = self.settings.bytes_per_token
        if new_bpt != old_bpt:
            factor = old_bpt / new_bpt
            # Open windows hold estimates made at the old value: into the new unit, or the
            # next window of every other endpoint measures the change itself.
            for w in self._windows.values():
                w.estimated = round(w.estimated * factor)
                w.paired_estimated = round(w.paired_estimated * factor)
                if w.pending is not None:
                    w.pending = deque((round(t * factor), m, at) for t, m, at in w.pending)
            self._open = OrderedDict(
                (rid, (a, round(t * factor), m, at)) for rid, (a, t, m, at) in self._open.items()
            )
            # The last ratios too (engine tokens per estimate: the estimates grew by the
            # factor): flow control's measured output scale reads them until the next window.
            self.stats.ratios = {a: r / factor for a, r in self.stats.ratios.items()}
            for listener in self.on_units:
                listener(factor)
            if announce and self.on_change is not None:
                self.on_change(new_bpt, self.settings.key_bpt)


def _enqueue(w: _Window, tokens: int, media: int, joined: float | None) -> None:
    """One placement's estimate (`tokens` of text, `media`) into the pairing queue; `joined`:
    when it joined at its request's end (None: at its placement)."""
    if w.pending is None:
        return
    if w.debt:  # the engine counted it already
        w.debt.popleft()
        w.paired_estimated += tokens
        w.paired_media += media
        return
    if len(w.pending) >= _MAX_PENDING:
        # The engine stopped counting what is placed there: pairing would compare requests
        # far apart; it starts again from the next placement.
        w.pending.clear()
        w.aligned = False
    w.pending.append((tokens, media, joined))


def _pair(w: _Window, finished: tuple[float, float] | None, now: float) -> int:
    """Pairs each request the engine counted since the last scrape with the oldest placement
    not yet paired; the ones counted before their placement arrived are paired when it
    does. Many more counted than placed (requests nobody here placed) unpairs the window;
    pairing resumes from an empty queue. Returns how many stale leftovers it dropped: ended
    placements and counts unpaired for `_STALE_S` (placements in placement order wait as
    long as their request runs, so they never go stale)."""
    if finished is None:
        return 0
    if w.pending is None:  # the histogram appeared mid-window: pairing from the next window
        w.pending, w.counted, w.aligned, w.opened = deque(), finished[1], False, now
        return 0
    stale = 0
    pending, debt = w.pending, w.debt
    while pending and (joined := pending[0][2]) is not None and now - joined > _STALE_S:
        pending.popleft()
        stale += 1
    while debt and now - debt[0] > _STALE_S:
        debt.popleft()
        stale += 1
    new = int(finished[1] - w.counted)
    w.counted = finished[1]
    if new <= 0:
        return stale
    take = min(new, len(pending))
    for _ in range(take):
        text, media, _joined = pending.popleft()
        w.paired_estimated += text
        w.paired_media += media
    debt.extend([now] * (new - take))
    if len(debt) > _MAX_DEBT:
        pending.clear()
        debt.clear()
        w.aligned = False
    return stale
