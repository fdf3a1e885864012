"""The simulator's physics: how long prefill, media encoding, CPU-tier loads and decode
take. Pure arithmetic over `TimingSettings`; the engine does the waiting.

    step   = step overhead + prefill(the step's tokens) + encode(uncached media of the
             prompts it starts) + load(their CPU hits); steps run one after another (the
             GPU's compute is shared: a long uncached prompt delays everyone behind it),
             filled under a token budget (`steps`)
    TTFT   = queueing + the steps until the prompt's last token is computed
    decode = per sequence, decode_tps / (1 + decode_slowdown * (running - 1)) tokens/s

`speed` compresses time: every rate is multiplied by it (fast mode for tests, `--fast N`).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

_PositiveRate = Annotated[float, msgspec.Meta(gt=0)]


class TimingSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Rates of one simulated server, in simulated seconds (before `speed`).

    - `prefill_tps` (10000): uncached prompt tokens per second, whole server.
    - `decode_tps` (60): output tokens per second of one sequence running alone.
    - `decode_slowdown` (0.01): per extra running sequence, the fraction by which every
      sequence's decode slows (batch 64 -> 1.63x slower per sequence).
    - `encode_tps` (20000): media tokens per second through the encoder, on an encoder
      cache miss.
    - `cpu_load_tps` (200000): tokens per second loaded back from the CPU tier.
    - `step_overhead_s` (0.002): fixed cost of one engine step with prefill work.
    - `speed` (1.0): time compression; 50 means everything runs 50x faster.
    """

    prefill_tps: _PositiveRate = 10000.0
    decode_tps: _PositiveRate = 60.0
    decode_slowdown: Annotated[float, msgspec.Meta(ge=0)] = 0.01
    encode_tps: _PositiveRate = 20000.0
    cpu_load_tps: _PositiveRate = 200000.0
    step_overhead_s: Annotated[float, msgspec.Meta(ge=0)] = 0.002
    speed: _PositiveRate = 1.0

    def prefill_s(self, uncached_tokens: int, encode_tokens: int, load_tokens: int) -> float:
        """Wall seconds of one prefill step (one request's, or a step's total)."""
        sim = (
            self.step_overhead_s
            + uncached_tokens / self.prefill_tps
            + encode_tokens / self.encode_tps
            + load_tokens / self.cpu_load_tps
        )
        return sim / self.speed

    def decode_rate(self, running: int) -> float:
        """Wall tokens per second of one sequence while `running` sequences decode."""
        slowdown = 1.0 + self.decode_slowdown * max(running - 1, 0)
        return self.decode_tps * self.speed / slowdown
