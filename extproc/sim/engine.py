"""One simulated vLLM engine: admission (FCFS, or by `priority` with the priority policy; a
max batch, KV-block capacity), the prefix cache and encoder cache consulted at admission,
prefill in engine steps (a token budget per step, prefills chunked, as vLLM's scheduler:
`steps`) timed at the `timing` rates, then decode at a batch-dependent rate. The HTTP layer
(`server`) turns the token chunks `generate` yields into OpenAI responses.

Owned by one event loop; `generate` may be cancelled at any point (a client that hangs up):
its blocks and batch slot are given back. A task of the engine's runs the prefill steps
while there is prefill work; `aclose` ends it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
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
from extproc.sim.steps import ChunkPolicy, Work, plan_step
from extproc.sim.timing import TimingSettings
from extproc.sim.tokens import PromptTokens, SimTokenizer, media_len

_Positive = Annotated[int, msgspec.Meta(gt=0)]
_log = logging.getLogger(__name__)


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
      slowed by another tenant) at once: the rest of the prefill step under way and every
      later one are stretched by the change (a GPU shared with another tenant slows the
      work it already holds, not only later work), decode from its next tick on.
    - `max_num_batched_tokens` (2048, vLLM's default for its API server on CPUs and GPUs
      below H100 class) [--max-num-batched-tokens]: the prefill tokens of one engine step,
      less one per decoding sequence. See `steps` for how a step is filled.
    - `enable_chunked_prefill` (True, vLLM's default) [--enable-chunked-prefill /
      --no-enable-chunked-prefill]: a prompt longer than the budget left is split across
      steps; without it a prompt waits for a step with room for all of it (then the budget
      must hold `max_model_len`, as vLLM requires).
    - `long_prefill_token_threshold` (0: off, vLLM's default)
      [--long-prefill-token-threshold]: with more than one request in the engine, no
      request takes more than this many tokens of a step.
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
    max_num_batched_tokens: _Positive = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: Annotated[int, msgspec.Meta(ge=0)] = 0

    def __post_init__(self) -> None:
        # vLLM's own checks (SchedulerConfig.verify_max_model_len), in its words.
        if self.max_num_batched_tokens < self.max_model_len and not self.enable_chunked_prefill:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}). Please increase max_num_batched_tokens "
                "or decrease max_model_len."
            )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be greater "
                f"than or equal to max_num_seqs ({self.max_num_seqs})."
            )
        if self.long_prefill_token_threshold > self.max_model_len:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) cannot "
                f"be greater than the max_model_len ({self.max_model_len})."
            )

    @property
    def chunk_policy(self) -> ChunkPolicy:
        return ChunkPolicy(
            self.max_num_batched_tokens,
            self.enable_chunked_prefill,
            self.long_prefill_token_threshold,
        )


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
    # KV blocks (FCFS admission), waiting for its first prefill step, and the prefill itself
    # (from its first step's start to its last step's end).
    timing: tuple[float, float, float] | None = None
    # On the first chunk only: the engine's KV as the request found it on arrival (a
    # benchmark compares it with what the picker's books held for the server then).
    arrival: ArrivalKV | None = None


@dataclass(frozen=True, slots=True)
class ArrivalKV:
    """The engine's KV when a request arrived, in blocks: `free` (allocatable, cached but
    unreferenced included), `need` (what its admission takes then: prompt + max_tokens less
    its GPU prefix hit), `held` (by admitted requests), `ahead` / `ahead_need`: requests
    not admitted yet before it in the admission queue (FCFS: it waits behind them) and the
    blocks they take (their hits not counted)."""

    free: int
    need: int
    held: int
    ahead: int
    ahead_need: int


class _State(enum.Enum):
    NEW = 0
    QUEUED = 1  # not admitted yet (batch full or no KV room)
    ADMITTED = 2  # blocks held, no prefill step yet: vLLM still says "waiting"
    RUNNING = 3  # prefilling (some steps done) or decoding
    DONE = 4


@dataclass(slots=True, eq=False)
class _Seq:
    job: Job
    chain: list[BlockInfo]
    extra_keys: list[list[str | int]] | None
    total_blocks: int
    admitted: asyncio.Future[None]
    prefilled: asyncio.Future[None]
    arrival: int = 0
    state: _State = _State.NEW
    held: list[PhysicalBlock] = field(default_factory=list)
    hit: Hit = field(default_factory=lambda: Hit(0, 0))
    filled: int = 0
    generated: list[int] = field(default_factory=list)
    admitted_at: float = 0.0
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    # Prefill work, fixed at admission: uncached prompt tokens (at least the last one), and
    # media tokens to encode and CPU-tier tokens to load (charged to its first step).
    to_compute: int = 0
    computed: int = 0
    encode_tokens: int = 0
    load_tokens: int = 0
    on_arrival: ArrivalKV | None = None


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
        self._chunks = settings.chunk_policy
        self._queue: deque[_Seq] = deque()
        self._admitted = 0
        self._arrivals = 0
        self._counts = dict.fromkeys(_State, 0)
        # Admitted, no prefill step yet (vLLM's waiting queue), and prefills under way in the
        # order they started (vLLM's running list, less the decoding ones).
        self._waiting: list[_Seq] = []
        self._prefilling: list[_Seq] = []
        self._stepper: asyncio.Task[None] | None = None
        self._step_end = 0.0  # of the step under way
        # Set when the step under way is re-timed (a speed change): the stepper re-reads it.
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
        if self._stepper is not None and not self._stepper.done() and self._step_end > now:
            # The step under way does the rest of its work at the new speed; later steps
            # are timed at it when they start.
            self._step_end = now + (self._step_end - now) * old / speed
            self._wake()

    async def aclose(self) -> None:
        """Ends the step task (the server's requests are gone by then)."""
        task, self._stepper = self._stepper, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def prefill_order(self) -> list[Job]:
        """The jobs whose prefill has not ended, in the order the engine schedules them:
        prefills under way, the admitted ones in the policy's order, the admission queue."""
        ordered = self._prefilling + self._waiting_order()
        return [s.job for s in ordered] + [s.job for s in self._queue if not s.admitted.cancelled()]

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
        self._arrivals += 1
        seq = _Seq(
            job=job,
            chain=chain_blocks(ids, bs, self.settings.model, extras),
            extra_keys=extras,
            total_blocks=self.cache.blocks_for(len(ids) + job.max_tokens - 1),
            admitted=loop.create_future(),
            prefilled=loop.create_future(),
            arrival=self._arrivals,
        )
        self._move(seq, _State.QUEUED)
        self._enqueue(seq)
        seq.on_arrival = self._arrival_kv(seq)
        try:
            self._admit()
            await seq.admitted
            await seq.prefilled
            cached = (seq.hit.gpu + seq.hit.cpu) * bs
            rng = random.Random(self._seed(job))
            first = self.tokenizer.sample(rng, 1)
            self._emit(seq, first)
            self.stats.ttft.observe(loop.time() - t0)
            timing = (
                seq.admitted_at - t0,
                seq.prefill_start - seq.admitted_at,
                seq.prefill_end - seq.prefill_start,
            )
            yield Chunk(first, cached, timing, seq.on_arrival)
            async for tokens in self._decode(seq, rng):
                yield Chunk(tokens, cached)
            self.stats.finished["length"] += 1
            # vLLM observes a request's phases when it finishes (update_from_finished_request),
            # not at its first token: a scraper sees a prefill's time only after its decode.
            # A request cut before its end (the client hung up) is observed nowhere: vLLM
            # 0.32 drops an aborted request's state without stats, so neither the finished
            # count nor these histograms move (tests/vllm/test_abort_counts.py).
            self.stats.prompt_hist.observe(len(ids))
            self.stats.generation_hist.observe(job.max_tokens)
            self.stats.queue_time.observe(seq.prefill_start - t0)
            self.stats.prefill_time.observe(seq.prefill_end - seq.prefill_start)
            self.stats.prefill_computed.observe(len(ids) - cached)
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
            seq.to_compute = prompt_len - hit_tokens  # at least 1: the last token never hits
            seq.encode_tokens = self._encode_tokens(seq.job.tokens, hit_tokens)
            seq.load_tokens = hit.cpu * bs
            seq.admitted_at = loop.time()
            self._waiting.append(seq)
            st = self.stats
            st.prompt_tokens += prompt_len
            st.cached_prompt_tokens += hit_tokens
            st.prefix_queries += prompt_len
            st.prefix_hits += hit.gpu * bs
            seq.admitted.set_result(None)
        self._flush()
        self._kick()

    def _arrival_kv(self, seq: _Seq) -> ArrivalKV:
        """The KV a request finds on arrival (queued, before `_admit` runs)."""
        cache = self.cache
        prompt_len = len(seq.job.tokens.ids)
        hit = cache.lookup(seq.chain, (prompt_len - 1) // self.settings.block_size)
        ahead = []
        for other in self._queue:
            if other is seq:
                break
            if not other.admitted.cancelled():
                ahead.append(other.total_blocks)
        free = cache.free_blocks
        return ArrivalKV(
            free=free,
            need=cache.cost(seq.chain, hit, seq.total_blocks),
            held=cache.usable_blocks - free,
            ahead=len(ahead),
            ahead_need=sum(ahead),
        )

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

    def _waiting_order(self) -> list[_Seq]:
        """Admitted prefills not started, in the order a step takes them: arrival (FCFS),
        or (priority, arrival) as vLLM's priority queue pops them."""
        if self.settings.scheduling_policy == "fcfs":
            return sorted(self._waiting, key=lambda s: s.arrival)
        return sorted(self._waiting, key=lambda s: (s.job.priority, s.arrival))

    def _kick(self) -> None:
        """Starts the step task if prefill work waits and none runs (it ends when idle)."""
        if (self._waiting or self._prefilling) and (self._stepper is None or self._stepper.done()):
            self._stepper = asyncio.get_running_loop().create_task(self._steps())
            self._stepper.add_done_callback(self._stepper_done)

    def _stepper_done(self, task: asyncio.Task[None]) -> None:
        """A step task that failed fails the requests it owed a first token (a 500 each,
        not a hang)."""
        if task.cancelled() or task.exception() is None:
            return
        _log.error("sim engine: prefill steps failed: %r", task.exception())
        for seq in self._waiting + self._prefilling:
            if not seq.prefilled.done():
                seq.prefilled.set_exception(
                    RuntimeError(f"prefill steps failed: {task.exception()!r}")
                )

    async def _steps(self) -> None:
        """Engine steps back to back while any prefill is left: each takes its chunks
        (`steps.plan_step`), lasts step_overhead + its tokens at the timing rates (decode is
        timed apart, per sequence, and not charged to steps), then credits them; a request
        whose prefill is complete gets its first token at the step's end."""
        loop = asyncio.get_running_loop()
        while True:
            decoding = self._counts[_State.RUNNING] - len(self._prefilling)
            eligible = self._counts[_State.RUNNING] + self._counts[_State.ADMITTED]
            eligible += self._counts[_State.QUEUED]
            plan = plan_step(
                self._chunks,
                [Work(s, s.to_compute - s.computed) for s in self._prefilling],
                [Work(s, s.to_compute) for s in self._waiting_order()],
                decoding,
                eligible,
            )
            if not plan:
                return  # idle, or every token of the budget decoding: a finish kicks again
            now = loop.time()
            tokens = encode = load = 0
            for w in plan:
                seq = w.item
                tokens += w.left
                if seq.state is _State.ADMITTED:  # its first step: vLLM's "running" from now
                    encode += seq.encode_tokens
                    load += seq.load_tokens
                    seq.prefill_start = now
                    self._waiting.remove(seq)
                    self._prefilling.append(seq)
                    self._move(seq, _State.RUNNING)
            self._step_end = now + self._timing.prefill_s(tokens, encode, load) / self._speed
            while (delay := self._step_end - loop.time()) > 0:
                if self._moved is None:
                    self._moved = loop.create_future()
                await asyncio.wait({self._moved}, timeout=delay)
            # The step's scheduled end, not this wake-up: on a loaded machine the wake-up
            # comes late, and the histograms would charge the delay to the step's prefills.
            end = self._step_end
            st = self.stats
            st.steps += 1
            st.step_tokens += tokens
            st.step_scheduled_s += end - now
            for w in plan:
                seq = w.item
                if seq.state is _State.DONE:
                    continue  # its client left during the step
                seq.computed += w.left
                if seq.computed >= seq.to_compute:
                    seq.prefill_end = end
                    self._prefilling.remove(seq)
                    seq.prefilled.set_result(None)
            # The woken requests run first: one that ends frees its batch slot (and admits
            # the next) before the next step is planned.
            await asyncio.sleep(0)
            # The lane's real time for the step: its wake-up's lateness and this turn too.
            st.step_wall_s += loop.time() - now

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
            if seq in self._waiting:
                self._waiting.remove(seq)
            if seq in self._prefilling:
                self._prefilling.remove(seq)
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
