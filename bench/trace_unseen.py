"""Issue 14: decisions made right after another replica placed on the chosen server, from
`bench/trace_routing.py`'s rows (explained decisions: predicted TTFT's terms per server).

    .venv/bin/python bench/trace_unseen.py /tmp/t/tenants-redis3-0.jsonl [...]

Per file: how many decisions chose a server another picker replica had sent a request to in
the previous `WINDOW_S` ("after a peer"; on one replica: its own previous placement there,
for comparison), the median and p10 of the chosen server's predicted queue less its real
prefill backlog at the decision (the latest first token of the requests sent to it before,
less the decision's send time: `trace_causes.real_backlog`), and the median TTFT of those
requests over the others'. Where a peer's placement was not yet seen, the predicted queue
falls short of the real backlog (negative); the fifteenth session measured -0.06 to -0.25 s
medians over 30-56 of 242 decisions with the 50 ms exchange (bench/RESULTS.md).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from trace_causes import real_backlog  # bench/ is on the path

WINDOW_S = 0.1
_SCORER = "default/predicted-ttft-scorer"


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def analyse(rows: list[dict]) -> str:
    ok = [r for r in rows if r.get("status") == 200 and r.get("decision") and "ttft_s" in r]
    ok.sort(key=lambda r: r["sent_s"])
    replicas = {r["decision"].get("picker", 0) for r in ok}
    after: list[tuple[float, float]] = []  # (predicted - real, ttft)
    rest: list[tuple[float, float]] = []
    for i, r in enumerate(ok):
        chosen, at = r["served_by"], r["sent_s"]
        me = r["decision"].get("picker", 0)
        recent = False
        for o in reversed(ok[:i]):
            if at - o["sent_s"] > WINDOW_S:
                break
            peer = len(replicas) == 1 or o["decision"].get("picker", 0) != me
            if o["served_by"] == chosen and peer:
                recent = True
                break
        terms = r["decision"].get("terms", {}).get(_SCORER, {}).get(chosen)
        if not terms or "queue_s" not in terms:
            continue
        diff = terms["queue_s"] - real_backlog(rows, chosen, at)
        (after if recent else rest).append((diff, r["ttft_s"]))
    if not after or not rest:
        return f"{len(ok)} decisions, {len(after)} after a placement there: too few to say"
    d = [x for x, _ in after]
    ratio = statistics.median(t for _, t in after) / statistics.median(t for _, t in rest)
    return (
        f"{len(ok)} decisions ({len(replicas)} replica(s)), {len(after)} after "
        f"{'a peer' if len(replicas) > 1 else 'its own'} placement there within "
        f"{WINDOW_S * 1000:.0f} ms: predicted - real queue median {statistics.median(d):+.3f} s, "
        f"p10 {_quantile(d, 0.1):+.3f} s (others: median "
        f"{statistics.median(x for x, _ in rest):+.3f} s); TTFT median x{ratio:.2f} the others'"
    )


def main(argv: list[str]) -> int:
    for path in argv:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line]
        print(f"{path}: {analyse(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
