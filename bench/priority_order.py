"""Which request an engine serves next, by `priority`: a real vLLM against the simulator.

One server with one batch slot (`--max-num-seqs 1`): a long request takes the slot, then
five short ones arrive while it decodes, with priorities 0, 0, -10, -1, 0 (in that order).
The order in which their first tokens come is the engine's scheduling order: with
`--scheduling-policy priority`, lower values first (ties by arrival); with FCFS, arrival.

    .venv/bin/python bench/priority_order.py vllm [--policy priority|fcfs]
    .venv/bin/python bench/priority_order.py sim [--policy priority|fcfs]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from extproc.stack import free_port, wait_until
from tests.vllm.fleet import DEFAULT_MODEL_DIR, VllmServer

SHORT = [("low1", 0), ("low2", 0), ("high", -10), ("mid", -1), ("low3", 0)]


async def first_token(c: httpx.AsyncClient, name: str, prio: int, max_tokens: int,
                      order: list[str], started: asyncio.Event | None = None) -> None:  # fmt: skip
    body = {"model": "tiny", "prompt": f"{name} says hello", "max_tokens": max_tokens,
            "stream": True, "priority": prio, "ignore_eos": True}  # fmt: skip
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        seen = False
        async for line in r.aiter_lines():  # read to the end: the slot frees at the end
            if not seen and line.startswith("data: {"):
                seen = True
                order.append(name)
                if started is not None:
                    started.set()


async def scenario(url: str, long_tokens: int) -> list[str]:
    order: list[str] = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        started = asyncio.Event()
        tasks = [asyncio.create_task(first_token(c, "long", 0, long_tokens, order, started))]
        await started.wait()
        for name, prio in SHORT:
            tasks.append(asyncio.create_task(first_token(c, name, prio, 2, order)))
            await asyncio.sleep(0.05)  # arrival order
        await asyncio.gather(*tasks)
    return order


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=("vllm", "sim"))
    ap.add_argument("--policy", choices=("priority", "fcfs"), default="priority")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="priority-order-"))
    port = free_port()
    if args.engine == "vllm":
        srv = VllmServer(port=port, kv_events_url=f"tcp://127.0.0.1:{free_port()}",
                         model_dir=DEFAULT_MODEL_DIR, log_path=root / "vllm.log", tmpdir=root,
                         extra_args=("--max-model-len", "512", "--max-num-seqs", "1",
                                     "--scheduling-policy", args.policy))  # fmt: skip
        srv.start()
        stop = srv.stop
        srv.wait_ready()
        long_tokens = 400
    else:
        proc = subprocess.Popen(
            [sys.executable, "-m", "extproc.sim", "--base-port", str(port), "--max-num-seqs",
             "1", "--scheduling-policy", args.policy, "--decode-tps", "200"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        stop = proc.terminate
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200,
                   timeout_s=30, what="sim", proc=proc)  # fmt: skip
        long_tokens = 400
    try:
        t = time.monotonic()
        order = asyncio.run(scenario(f"http://127.0.0.1:{port}", long_tokens))
        print(f"{args.engine} {args.policy}: first tokens in order {order} "
              f"({time.monotonic() - t:.1f} s)")  # fmt: skip
    finally:
        stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
