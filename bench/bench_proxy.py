"""What extproc adds to a request through Envoy, measured in one run.

Baseline: Envoy straight to one echo upstream (no ext_proc filter). Test: the same Envoy
bootstrap with the ext_proc filter and the extproc picker (one endpoint: the same upstream).
For 1 KB and 100 KB chat bodies at concurrency 1 and 16, `wrk` drives each for a fixed time;
we report p50/p99 latency of both, the added latency, and the picker's CPU time per request
(user+system from /proc, divided by requests served).

    apt-get install wrk   # once
    uv run python bench/bench_proxy.py [--seconds 5]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import yaml

from extproc.bootstrap import BootstrapOptions, build_bootstrap
from extproc.stack import Stack, StackOptions, envoy_binary, free_port, wait_until

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def chat_body(size: int) -> bytes:
    filler = "The quick brown fox jumps over the lazy dog. "
    text = (filler * (size // len(filler) + 1))[: max(0, size - 80)]
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime + stime


@dataclass
class WrkResult:
    requests: int
    p50_ms: float
    p99_ms: float
    rps: float
    non_2xx: int


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    assert m, text
    return float(m.group(1)) * _UNITS[m.group(2)]


def run_wrk(url: str, body_file: Path, conns: int, seconds: float) -> WrkResult:
    script = body_file.with_suffix(".lua")
    script.write_text(
        f'local f = io.open("{body_file}", "rb"); wrk.body = f:read("*all"); f:close()\n'
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
    )
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{conns}",
            f"-d{max(1, round(seconds))}s",
            "--latency",
            "-s",
            str(script),
            f"{url}/v1/chat/completions",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pct = dict(re.findall(r"^\s+(50|99)(?:\.0+)?%\s+(\S+)", out, re.M))
    reqs = int(re.search(r"(\d+) requests in", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    return WrkResult(
        reqs, _ms(pct["50"]), _ms(pct["99"]), rps, int(non2xx.group(1)) if non2xx else 0
    )


def start_envoy(doc: dict, workdir: Path, name: str) -> tuple[subprocess.Popen, str]:
    listener = doc["static_resources"]["listeners"][0]["address"]["socket_address"]
    admin = doc["admin"]["address"]["socket_address"]["port_value"]
    cfg = workdir / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    proc = subprocess.Popen(
        [
            envoy_binary(),
            "-c",
            str(cfg),
            "--disable-hot-restart",
            "--concurrency",
            "1",
            "--log-level",
            "warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_until(
        lambda: httpx.get(f"http://127.0.0.1:{admin}/ready").status_code == 200,
        timeout_s=30,
        what=f"{name} envoy",
        proc=proc,
    )
    return proc, f"http://127.0.0.1:{listener['port_value']}"


def bootstrap(**kw) -> dict:
    return build_bootstrap(
        BootstrapOptions(
            listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(), **kw
        )
    )


def baseline_doc(upstream: str) -> dict:
    """Envoy with the same listener but no ext_proc filter, to one static upstream."""
    doc = bootstrap(lb="override-host", endpoints=(upstream,))
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [
        f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"
    ]
    del doc["static_resources"]["clusters"][0]["load_balancing_policy"]
    return doc


def measure(url: str, body: Path, conns: int, seconds: int, pid: int | None):
    run_wrk(url, body, conns, 1)  # warm up connections and caches
    cpu0 = cpu_seconds(pid) if pid else 0.0
    res = run_wrk(url, body, conns, seconds)
    cpu_ms = (cpu_seconds(pid) - cpu0) / max(res.requests, 1) * 1e3 if pid else 0.0
    return res, cpu_ms


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=5)
    args = ap.parse_args()
    if shutil.which("wrk") is None:
        raise SystemExit("needs wrk: apt-get install wrk")
    rows = []
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp, Stack(StackOptions(upstreams=1)) as stack:
        work = Path(tmp)
        upstream = stack.upstream_addresses[0]
        try:
            base_proc, base_url = start_envoy(baseline_doc(upstream), work, "baseline")
            floor_port = free_port()
            floor = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).with_name("floor_processor.py")),
                    str(floor_port),
                    upstream,
                ]
            )
            floor_env, floor_url = start_envoy(
                bootstrap(extproc=f"127.0.0.1:{floor_port}"), work, "floor"
            )
            procs += [base_proc, floor, floor_env]
            picker_pid = stack._procs["extproc"].pid
            for size in (1024, 100 * 1024):
                body = work / f"body-{size}.json"
                body.write_bytes(chat_body(size))
                for conns in (1, 16):
                    base, _ = measure(base_url, body, conns, args.seconds, None)
                    flo, floor_cpu = measure(floor_url, body, conns, args.seconds, floor.pid)
                    test, cpu_ms = measure(stack.url, body, conns, args.seconds, picker_pid)
                    rows.append((size, conns, base, flo, floor_cpu, test, cpu_ms))
                    bad = base.non_2xx + flo.non_2xx + test.non_2xx
                    print(
                        f"{size // 1024:>4} KB c={conns:<3} envoy p50 {base.p50_ms:.3f} | "
                        f"floor p50 {flo.p50_ms:.3f} cpu {floor_cpu:.3f} | "
                        f"extproc p50 {test.p50_ms:.3f} cpu {cpu_ms:.3f} ms/req"
                        f"{'  NON-2XX ' + str(bad) if bad else ''}",
                        flush=True,
                    )
        finally:
            for p in procs:
                p.terminate()
                p.wait()
    print(
        "\n| body | conc | Envoy alone p50 / p99 ms | + floor processor p50 / p99 ms "
        "| + extproc p50 / p99 ms | extproc added p50 / p99 ms | extproc CPU ms/req "
        "| floor CPU ms/req | CPU vs floor | throughput vs Envoy alone |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size, conns, base, flo, floor_cpu, test, cpu_ms in rows:
        print(
            f"| {size // 1024} KB | {conns} | {base.p50_ms:.3f} / {base.p99_ms:.3f} "
            f"| {flo.p50_ms:.3f} / {flo.p99_ms:.3f} | {test.p50_ms:.3f} / {test.p99_ms:.3f} "
            f"| {test.p50_ms - base.p50_ms:+.3f} / {test.p99_ms - base.p99_ms:+.3f} "
            f"| {cpu_ms:.3f} | {floor_cpu:.3f} | {cpu_ms / floor_cpu if floor_cpu else 0:.2f}x "
            f"| {test.rps / base.rps:.2f}x |"
        )


if __name__ == "__main__":
    main()
