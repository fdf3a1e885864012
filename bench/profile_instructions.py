"""Instructions per request of the picker's (or the floor's) own loop, counted, not timed.

On a shared 2-core machine CPU time per request swings 20-30% between two runs of the same
code (bench/RESULTS.md, the A/A control), so a 10% change cannot be seen through Envoy or with
`time.process_time`. Instructions executed do not depend on the neighbours' load: this runs
`bench/profile_stream.py`'s in-process loop (the real `StreamHandler` of a real `App`, the
ext_proc messages of one 1 KB chat request decoded from bytes, every reply encoded, the
access-log entry) under valgrind's callgrind twice, with a few and with many requests, and
divides the difference by the difference in requests, so start-up cancels out. The count is
split by shared object: the interpreter's bytecode loop (`ceval.c`), the rest of libpython
(object allocation, dict and attribute look-ups, calls: what compiled code still pays),
protobuf (upb), libc, and each compiled extproc module, if any.

    apt-get install valgrind   # once
    uv run python bench/profile_instructions.py [--who picker,floor] [--low 50 --high 550]
        [--src DIR]   # another checkout (e.g. one with compiled modules) instead of this one

One run takes 2-3 minutes per loop (valgrind runs Python ~50x slower); both counts of a loop
run side by side. libcrypto and cryptography's Rust module are left out: the picker's TLS key
is generated at start-up, its cost split between the two differently run to run, and the loop
itself does no crypto.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent


async def _loop(n: int, who: str) -> None:
    sys.path.insert(0, str(Path.cwd() / "bench"))
    import profile_stream as ps  # the checkout's own copy (cwd), not necessarily this one's

    from extproc.config import Settings
    from extproc.endpoints import parse_endpoints
    from extproc.server.app import App
    from extproc.server.limits import BodyBudget
    from extproc.server.stream import StreamHandler

    base = Settings(endpoints=[ps.ENDPOINT])
    settings = Settings(
        endpoints=[ps.ENDPOINT],
        server=type(base.server)(port=0, health_port=0, admin_port=None),
    )
    async with App(settings, parse_endpoints(ps.ENDPOINT)) as app:
        cfg = settings.server
        handler = StreamHandler(
            app.router,
            max_body_bytes=cfg.max_body_bytes,
            metrics=app.metrics,
            budget=BodyBudget(limit=cfg.body_budget_bytes),
            body_timeout_s=cfg.body_timeout_s,
        )
        if who == "picker":
            await ps.picker_requests(handler, app, n, 2)
        else:
            await ps.floor_requests(n, 2)


def _split(out_file: Path) -> collections.Counter[str]:
    text = subprocess.run(
        ["callgrind_annotate", "--auto=no", "--threshold=100", str(out_file)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    by: collections.Counter[str] = collections.Counter()
    started = False
    for line in text.splitlines():
        if "file:function" in line:
            started = True
            continue
        m = re.match(r"\s*([\d,]+) \([ \d.]+%\)\s+(.*?)(?: \[(.*)\])?$", line)
        if not started or not m:
            continue
        obj = (m.group(3) or "").rsplit("/", 1)[-1]
        if "libpython" in obj or not obj:  # no object: an inlined libpython header function
            obj = "python: bytecode loop (ceval)" if "ceval.c" in m.group(2) else "python: rest"
        elif obj.startswith("_message."):
            obj = "protobuf (upb)"
        elif "__mypyc" in obj or (".cpython-" in obj and "/extproc/" in (m.group(3) or "")):
            obj = "compiled extproc modules"
        by[obj] += int(m.group(1).replace(",", ""))
    return by


def _startup_crypto(obj: str) -> bool:
    # The picker's TLS key, generated at start-up: callgrind splits its cost between
    # cryptography's Rust module and libcrypto differently run to run (the two cancel).
    return obj.startswith(("libcrypto", "_rust.abi3"))


def _count(src: Path, n: int, who: str, work: Path) -> collections.Counter[str]:
    out = work / f"cg.{who}.{n}.out"
    subprocess.run(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
         sys.executable, str(Path(__file__).resolve()), "--child", str(n), who],
        cwd=src, env={**os.environ, "PYTHONPATH": str(src)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True,
    )  # fmt: skip
    return _split(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--who", default="picker,floor")
    ap.add_argument("--low", type=int, default=50)
    ap.add_argument("--high", type=int, default=550)
    ap.add_argument("--src", default=str(HERE.parent), help="checkout whose extproc runs")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        asyncio.run(_loop(int(args.child[0]), args.child[1]))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("needs valgrind: apt-get install valgrind")
    src = Path(args.src).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        for who in args.who.split(","):
            with ThreadPoolExecutor(2) as pool:  # the two runs of a loop side by side
                lo_f = pool.submit(_count, src, args.low, who, Path(tmp))
                hi_f = pool.submit(_count, src, args.high, who, Path(tmp))
                lo, hi = lo_f.result(), hi_f.result()
            n = args.high - args.low
            per = {k: (hi[k] - lo[k]) / n for k in set(lo) | set(hi) if not _startup_crypto(k)}
            total = sum(per.values())
            print(f"{who} ({src}): {total / 1e3:.1f} k instructions per request")
            for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
                if abs(v) >= 500:
                    print(f"  {v / 1e3:8.1f} k  {v / total:6.1%}  {k}")


if __name__ == "__main__":
    main()
