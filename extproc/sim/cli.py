"""`python -m extproc.sim`: hosts N simulated vLLM servers in one process, prints one ready
line per server, and exits cleanly on SIGTERM/SIGINT.

    python -m extproc.sim --servers 3 --base-port 8100 --kv-events-base-port 5557 --fast 50

Server i listens on base-port + i, publishes KV events on kv-events-base-port + i and
serves replay on kv-replay-base-port + i (default: kv-events-base-port + 1000). A base
port of 0 picks free ports; the ready lines say which.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys

import msgspec

from extproc.sim.engine import EngineSettings
from extproc.sim.kvevents import KVEventsSettings
from extproc.sim.server import ServerSettings, SimServer
from extproc.sim.timing import TimingSettings
from extproc.sim.tokens import SimTokenizer

_REPLAY_OFFSET = 1000


def build_arg_parser(prog: str = "python -m extproc.sim") -> argparse.ArgumentParser:
    e, t = EngineSettings(), TimingSettings()
    p = argparse.ArgumentParser(prog=prog, description="Simulated vLLM servers (no GPU).")
    p.add_argument("--servers", type=int, default=1, help="servers to host (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--base-port", type=int, default=8100, help="HTTP port of server 0 (0: free)")
    p.add_argument("--model", default=e.model, help=f"served model name ({e.model})")
    p.add_argument("--block-size", type=int, default=e.block_size)
    p.add_argument("--num-gpu-blocks", type=int, default=e.num_gpu_blocks, help="KV capacity")
    p.add_argument("--num-cpu-blocks", type=int, default=0, help="CPU offload tier (0: off)")
    p.add_argument("--max-num-seqs", type=int, default=e.max_num_seqs, help="max batch")
    p.add_argument("--max-model-len", type=int, default=e.max_model_len)
    p.add_argument("--encoder-cache-items", type=int, default=e.encoder_cache_items)
    p.add_argument("--chat-max-tokens", type=int, default=256,
                   help="chat default when the request sets no max_tokens")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="priority: lower request `priority` first, as vLLM's (default fcfs)")
    c = p.add_argument_group("engine steps (vLLM's scheduler flags and defaults)")
    c.add_argument("--max-num-batched-tokens", type=int, default=e.max_num_batched_tokens,
                   help="prefill tokens per engine step, less one per decoding sequence")
    c.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=e.enable_chunked_prefill,
                   help="split prompts longer than a step's budget across steps")  # fmt: skip
    c.add_argument("--long-prefill-token-threshold", type=int,
                   default=e.long_prefill_token_threshold,
                   help="cap on one request's tokens per step, others waiting (0: off)")
    g = p.add_argument_group("timing (simulated seconds; --fast divides them all)")
    g.add_argument("--prefill-tps", type=float, default=t.prefill_tps)
    g.add_argument("--decode-tps", type=float, default=t.decode_tps)
    g.add_argument("--decode-slowdown", type=float, default=t.decode_slowdown)
    g.add_argument("--encode-tps", type=float, default=t.encode_tps)
    g.add_argument("--cpu-load-tps", type=float, default=t.cpu_load_tps)
    g.add_argument("--step-overhead-s", type=float, default=t.step_overhead_s)
    g.add_argument("--speeds", default="1", metavar="F,F,...",
                   help="relative speed of each server (one value: all), e.g. 1,1,0.5,0.25; "
                        "POST /sim/speed changes it while running")  # fmt: skip
    g.add_argument("--fast", type=float, default=1.0, metavar="FACTOR",
                   help="compress time: every rate x FACTOR")  # fmt: skip
    k = p.add_argument_group("KV events (off unless a port or --kv-events-connect is given)")
    k.add_argument("--kv-events-base-port", type=int, default=None,
                   help="PUB port of server 0, bound on --host (0: free ports)")  # fmt: skip
    k.add_argument("--kv-events-connect", default=None, metavar="URL",
                   help="connect every PUB socket to URL (a subscriber that binds)")  # fmt: skip
    k.add_argument(
        "--kv-replay-base-port",
        type=int,
        default=None,
        help=f"ROUTER replay port of server 0 (default events + {_REPLAY_OFFSET})",
    )
    k.add_argument("--no-kv-replay", action="store_true", help="no replay sockets")
    k.add_argument("--kv-topic", default=None,
                   help="topic (default llm-d's kv@<host:port>@<model>)")  # fmt: skip
    k.add_argument("--kv-hash-bytes", action="store_true",
                   help="32-byte hashes instead of 64-bit ints")  # fmt: skip
    k.add_argument("--kv-event-format", choices=("map", "array"), default="map")
    return p


def server_settings(args: argparse.Namespace) -> list[ServerSettings]:
    """One `ServerSettings` per server, from parsed flags."""
    if args.servers < 1:
        raise ValueError("--servers must be at least 1")
    engine = EngineSettings(
        model=args.model,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        num_cpu_blocks=args.num_cpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        encoder_cache_items=args.encoder_cache_items,
        seed=args.seed,
        scheduling_policy=args.scheduling_policy,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        timing=TimingSettings(
            prefill_tps=args.prefill_tps,
            decode_tps=args.decode_tps,
            decode_slowdown=args.decode_slowdown,
            encode_tps=args.encode_tps,
            cpu_load_tps=args.cpu_load_tps,
            step_overhead_s=args.step_overhead_s,
            speed=args.fast,
        ),
    )
    speeds = [float(v) for v in str(args.speeds).split(",") if v.strip()]
    if len(speeds) == 1:
        speeds *= args.servers
    if len(speeds) != args.servers or any(not v > 0 for v in speeds):
        raise ValueError("--speeds needs one positive value, or one per server")
    out = []
    for i in range(args.servers):
        port = args.base_port + i if args.base_port else 0
        out.append(
            ServerSettings(
                host=args.host,
                port=port,
                engine=msgspec.structs.replace(engine, relative_speed=speeds[i]),
                kv_events=_kv_events(args, i),
                chat_max_tokens=args.chat_max_tokens,
            )
        )
    return out


def _kv_events(args: argparse.Namespace, i: int) -> KVEventsSettings | None:
    base = args.kv_events_base_port
    if base is None and args.kv_events_connect is None:
        return None
    host = f"[{args.host}]" if ":" in args.host else args.host
    if args.kv_events_connect is not None:
        endpoint, bind = args.kv_events_connect, False
    else:
        endpoint, bind = f"tcp://{host}:{base + i if base else '*'}", True
    replay = None
    if not args.no_kv_replay:
        rbase = args.kv_replay_base_port
        if rbase is None:
            rbase = base + _REPLAY_OFFSET if base else 0
        replay = f"tcp://{host}:{rbase + i if rbase else '*'}"
    return KVEventsSettings(
        endpoint=endpoint,
        bind=bind,
        replay_endpoint=replay,
        topic=args.kv_topic,
        hash_bytes=args.kv_hash_bytes,
        event_format=args.kv_event_format,
    )


async def serve(settings: list[ServerSettings], stop: asyncio.Event) -> None:
    """Starts every server, prints its ready line, and runs until `stop` is set."""
    tokenizer = SimTokenizer()
    async with contextlib.AsyncExitStack() as stack:
        for s in settings:
            srv = await stack.enter_async_context(SimServer(s, tokenizer))
            print(srv.ready_line(), flush=True)
        await stop.wait()


async def _main(settings: list[ServerSettings]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(settings, stop)


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    try:
        settings = server_settings(args)
        asyncio.run(_main(settings))
    except (OSError, ValueError) as exc:
        print(f"extproc sim: {exc}", file=sys.stderr)
        return 1
    return 0
