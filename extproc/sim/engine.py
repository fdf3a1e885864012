"""One simulated vLLM engine: admission (FCFS, or by `priority` with the priority policy; a
max batch, KV-block capacity), the prefix cache and encoder cache consulted at admission,
prefill served one request at a time at the `timing` rates, then decode at a batch-dependent
rate. The HTTP layer (`server`) turns the
token chunks `generate` yields into OpenAI responses.

Owned by one event loop; `generate` is the only coroutine and may be cancelled at any point
(a client that hangs up): its blocks and batch slot are given back.
"""

from __future__ import annotations

import asyncio
import enum
import random
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec

from extproc.errors import BadRequest
from extproc.sim.blocks import BlockInfo, chain_blocks
from extproc.sim.cache import CacheEvent, Hit, KVCache, PhysicalBlock
from extproc.sim.encoder import EncoderCache
from extproc.sim.metrics import EngineStats, Gauges
from extproc.sim.timing import TimingSettings
from extproc.sim.tokens import PromptTokens, SimTokenizer, media_len

_Positive = Annotated[int, msgspec.Meta(gt=0)]


class EngineSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One engine's shape (vLLM flag in brackets).

    - `model` ("tiny"): the served model name [--served-model-name].
    - `block_size` (16) tokens per KV block [--block-size]; `num_gpu_blocks` (8192) blocks
      of KV capacity [--num-gpu-blocks-override]; `num_cpu_blocks` (0 = no CPU tier).
    - `max_num_seqs` (256): requests admitted at once [--max-num-seqs]; the rest wait.
    - `max_model_len` (8192): prompt + output tokens allowed [--max-model-len].
    - `encoder_cache_items` (2048): media items whose encoder output is kept.
    - `seed` (0): output tokens are a function of (seed, request seed or prompt).
    - `min_tick_s` (0.005): wall seconds between token emissions at least; tokens due in
      between go out together (each still its own SSE chunk), bounding CPU per stream.
    - `scheduling_policy` ("fcfs") [--scheduling-policy]: "priority" serves a lower request
      `priority` first (ties by arrival), as vLLM's priority policy orders its waiting
      queue: in the admission queue and among admitted prefills not started yet (the sim's
      ADMITTED state is still "waiting" in vLLM); a prefill under way is not preempted.
      vLLM also preempts its lowest-priority running request when a running one needs KV
      blocks; the sim holds prompt + max_tokens from admission, so none ever needs more.
      "fcfs" ignores `priority` (vLLM 0.32 accepts a non-zero one without the policy).
    - `relative_speed` (1.0): this server's speed against the `timing` rates (0.5: half as
      fast, a smaller GPU); `Engine.relative_speed` changes it while running (a server
      slowed by another tenant) at once: the rest of the prefill under way and every
      admitted prefill still waiting are stretched by the change (a GPU shared with another
      tenant slows the work it already holds, not only later work), decode from its next
      tick on.
    """

    model: str = "tiny"
    block_size: _Positive = 16
    num_gpu_blocks: _Positive = 8192
    num_cpu_blocks: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_num_seqs: _Positive = 256
    max_model_len: _Positive = 8192
    encoder_cache_items: Annotated[int, msgspec.Meta(ge=0)] = 2048
    seed: int = 0
    min_tick_s: Annotated[float, msgspec.Meta(gt=0)] = 0.005
    timing: TimingSettings = TimingSettings()
    relative_speed: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"


@dataclass(frozen=True, slots=True)
class Job:
    """One generation: prompt ids, `max_tokens` (>= 1) to produce, and what keys its cache
    blocks. `stream` only changes how often the engine wakes up."""

    tokens: PromptTokens
    max_tokens: int
    cache_salt: str | None = None
    seed: int | None = None
    stream: bool = False
    priority: int = 0  # lower first, with the priority scheduling policy


@dataclass(frozen=True, slots=True)
class Chunk:
    """Tokens produced since the previous chunk; `cached_tokens` is the prefix hit."""

    token_ids: list[int]
    cached_tokens: int
    # On the first chunk only: where its time to first token went, in seconds: waiting for
    # KV blocks (FCFS admission), waiting for the prefill lane, and the prefill itself.
    timing: tuple[float, float, float] | None = None


class _State(enum.Enum):
    NEW = 0
    QUEUED = 1  # not admitted yet (batch full or no KV room)
    ADMITTED = 2  # blocks held, its prefill waits behind others: vLLM still says "waiting"
    RUNNING = 3
    DONE = 4


@dataclass(slots=True, eq=False)
class _Seq:
    job: Job
    chain: list[BlockInfo]
    extra_keys: list[list[str | int]] | None
    total_blocks: int
    admitted: asyncio.Future[None]
    state: _State = _State.NEW
    held: list[PhysicalBlock] = field(default_factory=list)
    hit: Hit = field(default_factory=lambda: Hit(0, 0))
    filled: int = 0
    generated: list[int] = field(default_factory=list)
    admitted_at: float = 0.0
    prefill_start: float = 0.0
    prefill_end: float = 0.0


class Engine:
    """See the module docstring. `on_events` receives each batch of cache events (one per
    scheduling pass, evictions first), e.g. `KVEventPublisher.publish`."""

    def __init__(
        self,
        settings: EngineSettings,
        tokenizer: SimTokenizer,
        on_events: Callable[[Sequence[CacheEvent]], None] | None = None,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer
        self.cache = KVCache(settings.num_gpu_blocks, settings.block_size, settings.num_cpu_blocks)
        self.encoder = EncoderCache(settings.encoder_cache_items)
        self.stats = EngineStats(settings.max_model_len)
        self._on_events = on_events
        self._timing = settings.timing
        self._queue: deque[_Seq] = deque()
        self._admitted = 0
        self._counts = dict.fromkeys(_State, 0)
        self._lane_free_at = 0.0
        # Admitted prefills not yet ended, in lane order (rescheduled by a speed change).
        self._lane: deque[_Seq] = deque()
        # Set when the lane is rescheduled, so sleepers wake and re-read their times.
        self._moved: asyncio.Future[None] | None = None
        self._speed = settings.relative_speed

    @property
    def relative_speed(self) -> float:
        return self._speed

    @relative_speed.setter
    def relative_speed(self, speed: float) -> None:
        old, self._speed = self._speed, speed
        try:
            now = asyncio.get_running_loop().time()
        except RuntimeError:
            return  # no loop, nothing in flight
        self._reschedule(old / speed, now)

    def _reschedule(self, factor: float, now: float) -> None:
        """Stretches (factor > 1) or shrinks the lane's remaining prefill work from `now`:
        the prefill under way keeps what it did and does the rest at the new speed; the
        admitted ones behind it follow back to back, as they were scheduled."""
        lane = self._lane
        while lane and lane[0].prefill_end <= now:
            lane.popleft()
        if not lane:
            return
        cursor = now
        for seq in lane:
            if seq.prefill_start <= now:  # under way
                seq.prefill_end = now + (seq.prefill_end - now) * factor
            else:
                work = (seq.prefill_end - seq.prefill_start) * factor
                seq.prefill_start = cursor  # back to back: it was queued behind the last
                seq.prefill_end = seq.prefill_start + work
            cursor = seq.prefill_end
        self._lane_free_at = cursor
        self._wake()

    async def _wait_lane(self, seq: _Seq, ends: bool) -> None:
        """Sleeps until `seq`'s prefill starts (or ends, with `ends`), following reschedules."""
        loop = asyncio.get_running_loop()
        while (delay := (seq.prefill_end if ends else seq.prefill_start) - loop.time()) > 0:
            if self._moved is None:
                self._moved = loop.create_future()
            await asyncio.wait({self._moved}, timeout=delay)

    def prefill_order(self) -> list[Job]:
        """The jobs whose prefill has not ended, in the order the engine will end them: the
        admitted ones by their place in the prefill lane, then the admission queue."""
        now = asyncio.get_running_loop().time()
        lane = [s.job for s in self._lane if s.prefill_end > now and s.state is not _State.DONE]
        return lane + [s.job for s in self._queue if not s.admitted.cancelled()]

    def gauges(self) -> Gauges:
        waiting = self._counts[_State.QUEUED] + self._counts[_State.ADMITTED]
        return Gauges(self._counts[_State.RUNNING], waiting, self.cache.usage)

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Raises `BadRequest` (vLLM's wording) for a request this engine can never serve."""
        s = self.settings
        if prompt_len + max_tokens > s.max_model_len:
            raise BadRequest(
                f"This model's maximum context length is {s.max_model_len} tokens. However, "
                f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the "
                f"messages, {max_tokens} in the completion). Please reduce the length of "
                "the messages or completion."
            )
        if self.cache.blocks_for(prompt_len + max_tokens - 1) > self.cache.usable_blocks:
            raise BadRequest(
                f"The request needs {prompt_len + max_tokens} tokens of KV cache but this "
                f"server holds {self.cache.usable_blocks * s.block_size}."
            )

    def reset_prefix_cache(self) -> None:
        self.cache.reset()
        self._flush()

    async def generate(self, job: Job) -> AsyncGenerator[Chunk, None]:
        """Yields the first token at TTFT, then decoded tokens until `max_tokens`."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ids = job.tokens.ids
        self.check(len(ids), job.max_tokens)
        bs = self.settings.block_size
        extras = job.tokens.extra_keys(bs, job.cache_salt)
        seq = _Seq(
            job=job,
            chain=chain_blocks(ids, bs, self.settings.model, extras),
            extra_keys=extras,
            total_blocks=self.cache.blocks_for(len(ids) + job.max_tokens - 1),
            admitted=loop.create_future(),
        )
        self._move(seq, _State.QUEUED)
        self._enqueue(seq)
        try:
            self._admit()
            await seq.admitted
            await self._wait_lane(seq, ends=False)
            self._move(seq, _State.RUNNING)
            self.stats.queue_time.observe(seq.prefill_start - t0)
            await self._wait_lane(seq, ends=True)
            self.stats.prefill_time.observe(seq.prefill_end - seq.prefill_start)
            cached = (seq.hit.gpu + seq.hit.cpu) * bs
            self.stats.prefill_computed.observe(len(ids) - cached)
            rng = random.Random(self._seed(job))
            first = self.tokenizer.sample(rng, 1)
            self._emit(seq, first)
            self.stats.ttft.observe(loop.time() - t0)
            timing = (
                seq.admitted_at - t0,
                seq.prefill_start - seq.admitted_at,
                seq.prefill_end - seq.prefill_start,
            )
            yield Chunk(first, cached, timing)
            async for tokens in self._decode(seq, rng):
                yield Chunk(tokens, cached)
            self.stats.finished["length"] += 1
            self.stats.decode_time.observe(loop.time() - seq.prefill_end)
            if job.max_tokens > 1:
                decode_s = loop.time() - seq.prefill_end
                self.stats.tpot.observe(decode_s / (job.max_tokens - 1))
            self.stats.e2e.observe(loop.time() - t0)
        finally:
            self._finish(seq)

    async def _decode(self, seq: _Seq, rng: random.Random) -> AsyncIterator[list[int]]:
        loop = asyncio.get_running_loop()
        remaining = seq.job.max_tokens - 1
        last = loop.time()
        due = 0.0
        while remaining > 0:
            rate = self._timing.decode_rate(self._counts[_State.RUNNING]) * self.relative_speed
            if seq.job.stream:
                tick = max(self.settings.min_tick_s, 1.0 / rate)
            else:  # one wake-up per 50 ms is enough to follow batch changes
                tick = max(self.settings.min_tick_s, min(remaining / rate, 0.05))
            await asyncio.sleep(tick)
            now = loop.time()
            due += (now - last) * rate
            elapsed, last = now - last, now
            n = min(remaining, int(due))
            if n == 0:
                continue
            due -= n
            remaining -= n
            for _ in range(n):
                self.stats.itl.observe(elapsed / n)
            tokens = self.tokenizer.sample(rng, n)
            self._emit(seq, tokens)
            yield tokens

    def _emit(self, seq: _Seq, tokens: list[int]) -> None:
        """Counts generated tokens and caches the blocks they filled. The newest token's KV
        is not computed yet (it is the next step's input), as in vLLM."""
        seq.generated += tokens
        self.stats.generation_tokens += len(tokens)
        bs = self.settings.block_size
        ids = seq.job.tokens.ids
        computed = len(ids) + len(seq.generated) - 1
        full = computed // bs
        if full <= seq.filled:
            return
        all_ids = [*ids, *seq.generated][: full * bs]
        infos = chain_blocks(all_ids, bs, self.settings.model, seq.extra_keys, start=seq.filled)
        self.cache.fill(seq.held, infos, seq.filled)
        seq.filled = full
        self._flush()

    def _admit(self) -> None:
        """FCFS: admits from the head while a batch slot and enough KV blocks are free."""
        loop = asyncio.get_running_loop()
        bs = self.settings.block_size
        while self._queue and self._admitted < self.settings.max_num_seqs:
            seq = self._queue[0]
            if seq.admitted.cancelled():
                self._queue.popleft()
                continue
            prompt_len = len(seq.job.tokens.ids)
            # vLLM always computes the last prompt token, so at most (len - 1) tokens hit.
            hit = self.cache.lookup(seq.chain, (prompt_len - 1) // bs)
            if not self.cache.can_allocate(seq.chain, hit, seq.total_blocks):
                break
            self._queue.popleft()
            seq.held = self.cache.acquire(seq.chain, hit, seq.total_blocks)
            seq.hit = hit
            seq.filled = len(seq.chain)
            self._admitted += 1
            self._move(seq, _State.ADMITTED)
            hit_tokens = (hit.gpu + hit.cpu) * bs
            encode = self._encode_tokens(seq.job.tokens, hit_tokens)
            work = self._timing.prefill_s(prompt_len - hit_tokens, encode, hit.cpu * bs)
            work /= self.relative_speed
            seq.admitted_at = loop.time()
            lane = self._lane
            # Ended by now: bounded by what is still queued. (Not by this one's start, which
            # is in the future behind a queue: that dropped every admitted prefill but the
            # last, so a slowdown stretched only the newest and the rest kept their speed.)
            while lane and lane[0].prefill_end <= loop.time():
                lane.popleft()
            self._into_lane(seq, work, seq.admitted_at)
            st = self.stats
            st.prompt_tokens += prompt_len
            st.cached_prompt_tokens += hit_tokens
            st.prefix_queries += prompt_len
            st.prefix_hits += hit.gpu * bs
            st.prompt_hist.observe(prompt_len)
            st.generation_hist.observe(seq.job.max_tokens)
            seq.admitted.set_result(None)
        self._flush()

    def _enqueue(self, seq: _Seq) -> None:
        """Into the admission queue: at the end (FCFS), or behind every request of its
        priority or a lower value (the priority policy; arrival order within a priority)."""
        queue = self._queue
        if self.settings.scheduling_policy == "fcfs" or not queue:
            queue.append(seq)
            return
        p = seq.job.priority
        pos = len(queue)
        while pos > 0 and queue[pos - 1].job.priority > p:
            pos -= 1
        queue.insert(pos, seq)

    def _into_lane(self, seq: _Seq, work: float, now: float) -> None:
        """Schedules `seq`'s prefill: after the last one (FCFS), or, with the priority policy,
        ahead of admitted prefills of a higher value that have not started (they move back
        by its work; their sleepers wake and re-read their times)."""
        lane = self._lane
        pos = len(lane)
        if self.settings.scheduling_policy == "priority":
            p = seq.job.priority
            for i, other in enumerate(lane):
                if other.prefill_start > now and other.job.priority > p:
                    pos = i
                    break
        if pos == len(lane):
            seq.prefill_start = max(now, self._lane_free_at)
            seq.prefill_end = self._lane_free_at = seq.prefill_start + work
            lane.append(seq)
            return
        seq.prefill_start = max(now, lane[pos - 1].prefill_end) if pos else now
        seq.prefill_end = seq.prefill_start + work
        lane.insert(pos, seq)
        cursor = seq.prefill_end
        for i in range(pos + 1, len(lane)):
            other = lane[i]
            length = other.prefill_end - other.prefill_start
            other.prefill_start = cursor
            other.prefill_end = cursor = cursor + length
        self._lane_free_at = cursor
        self._wake()

    def _wake(self) -> None:
        if self._moved is not None and not self._moved.done():
            self._moved.set_result(None)
        self._moved = None

    def _encode_tokens(self, tokens: PromptTokens, hit_tokens: int) -> int:
        """Media tokens to run through the encoder: items reaching past the cached prefix
        whose outputs are not in the encoder cache."""
        total = 0
        for item, start in tokens.media:
            if start + media_len(item) <= hit_tokens:
                continue
            self.stats.mm_queries += 1
            if self.encoder.touch(item.content_hash):
                self.stats.mm_hits += 1
            else:
                total += media_len(item)
        return total

    def _finish(self, seq: _Seq) -> None:
        if seq.state is _State.QUEUED:
            if seq in self._queue:
                self._queue.remove(seq)
            seq.admitted.cancel()
        elif seq.state is not _State.DONE:
            if len(seq.generated) < seq.job.max_tokens:
                self.stats.finished["abort"] += 1
            self.cache.release(seq.held)
            seq.held = []
            self._admitted -= 1
        self._move(seq, _State.DONE)
        self._admit()

    def _move(self, seq: _Seq, state: _State) -> None:
        self._counts[seq.state] -= 1
        self._counts[state] += 1
        seq.state = state

    def _seed(self, job: Job) -> int:
        # Without a request seed, the same prompt gives the same output (like greedy).
        base = job.seed if job.seed is not None else hash(job.tokens.ids)
        return hash((self.settings.seed, base))

    def _flush(self) -> None:
        events = self.cache.events
        if not events:
            return
        self.cache.events = []
        if self._on_events is not None:
            self._on_events(events)
