"""What `flow_control.engine_priority` costs the picker per request, through Envoy, in one run.

One stack per form (echo upstream + `extproc serve` + Envoy), flow control on in all (a
concurrency detector that never holds), engine priority off / `body` (written into the
body) / `header` (sent as `x-vllm-priority`, the body untouched), each in the
FULL_DUPLEX_STREAMED and BUFFERED exchanges. `wrk` drives them in turn, round after round
(off, body, header, off, body, header, ...: load from other processes hits all alike), with
chat bodies of each size, without a client `priority` (the body form inserts the field) and
with one (the body form re-encodes the body). Reported: medians over rounds of the picker's
CPU per request (user+system from /proc / requests served) and wrk's p50 / p99, as
bench/bench_proxy.py does.

    uv run python bench/bench_engine_priority.py [--seconds 4] [--rounds 3] [--sizes 1,400]
        [--forms off,body,header]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import orjson
import yaml
from bench_proxy import chat_body, measure, require_wrk  # bench/ is on the path

from extproc.bootstrap import build_bootstrap
from extproc.stack import Stack, StackOptions

SCHEDULING = {
    "plugins": [
        {"type": "queue-scorer"},
        {"type": "max-score-picker"},
        {"type": "concurrency-detector", "parameters": {"maxConcurrency": 100000}},
    ],
    "flowControl": {"saturationDetector": {"pluginRef": "concurrency-detector"}},
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}],
        }
    ],
}


def with_client_priority(body: bytes) -> bytes:
    doc = orjson.loads(body)
    doc["priority"] = 3
    return orjson.dumps(doc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default="1,400", help="body sizes in KB")
    ap.add_argument("--conns", type=int, default=4)
    ap.add_argument("--forms", default="off,body,header", help="engine_priority settings")
    args = ap.parse_args()
    require_wrk()
    forms = args.forms.split(",")
    setting = {"off": False, "body": "body", "header": "header"}
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stacks:
        work = Path(tmp)
        bodies: list[tuple[str, Path]] = []
        for kb in (int(x) for x in args.sizes.split(",")):
            plain = chat_body(kb * 1024)
            forged = with_client_priority(plain)
            for label, data in ((f"{kb} KB", plain), (f"{kb} KB + client priority", forged)):
                path = work / f"body-{len(bodies)}.json"
                path.write_bytes(data)
                bodies.append((label, path))
        targets = []
        for mode in ("FULL_DUPLEX_STREAMED", "BUFFERED"):
            for form in forms:
                cfg = work / f"picker-{mode}-{form}.yaml"
                cfg.write_text(yaml.safe_dump({
                    "scheduling": SCHEDULING,
                    "flow_control": {"engine_priority": setting[form]},
                }))  # fmt: skip
                opts = StackOptions(
                    upstreams=1,
                    extproc_args=("--config", str(cfg)),
                    bootstrap=lambda o, m=mode: build_bootstrap(replace(o, request_body_mode=m)),
                )
                stack = stacks.enter_context(Stack(opts))
                name = f"{'FD' if mode.startswith('FULL') else 'BUF'} {form}"
                targets.append((name, stack.url, stack._procs["extproc"].pid))
        results: dict[tuple[str, str], list] = {}
        for r in range(args.rounds):
            for label, body in bodies:
                for name, url, pid in targets:
                    res, cpu_ms = measure(url, body, args.conns, args.seconds, pid)
                    results.setdefault((label, name), []).append((res, cpu_ms))
            print(f"round {r + 1} done", flush=True)
        print(f"\n{'body':<28} {'config':<10} {'cpu ms/req':>10} {'p50 ms':>8} {'p99 ms':>8} "
              f"{'req/s':>7} {'non-2xx':>7}  cpu per round")  # fmt: skip
        for (label, name), runs in results.items():
            cpu = statistics.median(c for _, c in runs)
            p50 = statistics.median(x.p50_ms for x, _ in runs)
            p99 = statistics.median(x.p99_ms for x, _ in runs)
            rps = statistics.median(x.rps for x, _ in runs)
            bad = sum(x.non_2xx for x, _ in runs)
            each = " ".join(f"{c:.3f}" for _, c in runs)
            print(f"{label:<28} {name:<10} {cpu:>10.3f} {p50:>8.2f} {p99:>8.2f} {rps:>7.0f} "
                  f"{bad:>7}  {each}")  # fmt: skip


if __name__ == "__main__":
    main()
