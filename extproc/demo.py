"""`extproc demo`: a real Envoy, the extproc picker and local upstreams on this machine,
with requests routed through them and a summary of where each went.

Grows with the product: for now the upstreams are echo servers and the policy spreads load.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections import Counter

import httpx

from extproc import protocol
from extproc.stack import Stack, StackOptions


def _chat(i: int) -> dict:
    return {
        "model": "demo-model",
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": f"Question number {i}: what is {i} + {i}?"},
        ],
    }


def run_demo(*, requests: int = 30, upstreams: int = 3, concurrency: int = 4) -> int:
    print(f"starting {upstreams} upstreams, extproc and Envoy ...", flush=True)
    t0 = time.monotonic()
    with Stack(StackOptions(upstreams=upstreams, unlisted_upstreams=1)) as stack:
        print(f"ready in {time.monotonic() - t0:.1f}s: Envoy on {stack.url}\n")
        served: Counter[str] = Counter()
        obeyed = 0
        latencies: list[float] = []

        def send(i: int) -> tuple[int, dict, float]:
            with httpx.Client(base_url=stack.url, timeout=30) as c:
                start = time.perf_counter()
                r = c.post("/v1/chat/completions", json=_chat(i))
                return r.status_code, r.json(), time.perf_counter() - start

        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            for i, (status, seen, dt) in enumerate(pool.map(send, range(requests))):
                served[seen["endpoint"]] += 1
                obeyed += seen["destination_header"] == seen["endpoint"]
                latencies.append(dt)
                if i < 8:
                    print(
                        f"  request {i:>3} -> {seen['endpoint']}  HTTP {status}  {dt * 1000:.1f} ms"
                    )
        if requests > 8:
            print(f"  ... {requests - 8} more")

        print("\nWhat a client cannot do:")
        with httpx.Client(base_url=stack.url, timeout=30) as c:
            rogue = stack.unlisted_addresses[0]
            r = c.post(
                "/v1/chat/completions", json=_chat(0), headers={protocol.DESTINATION_HEADER: rogue}
            )
            print(
                f"  spoofed {protocol.DESTINATION_HEADER}: {rogue} -> served by "
                f"{r.json()['endpoint']} (picker's choice)"
            )
            r = c.post(
                "/v1/chat/completions",
                content=b'{"model": ',
                headers={"content-type": "application/json"},
            )
            print(f"  malformed JSON -> HTTP {r.status_code}: {r.json()['error']['message']}")

        latencies.sort()
        p50 = latencies[len(latencies) // 2] * 1000
        print(f"\n{'endpoint':<22} {'requests':>8}")
        for addr in stack.upstream_addresses:
            print(f"{addr:<22} {served[addr]:>8}")
        print(
            f"\n{obeyed}/{requests} requests reached exactly the endpoint extproc chose; "
            f"p50 latency {p50:.1f} ms through Envoy"
        )
    print("all processes stopped")
    return 0 if obeyed == requests else 1
