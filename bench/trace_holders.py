"""Where each repeat of a one-shot prefix group (bench_routing's multimodal or text) went
against the endpoint the index credited with most of its prompt, from one
`bench/trace_routing.py` trace (explained decisions, one JSON line per request).

    uv run python bench/trace_holders.py trace/multimodal-approximate-0.jsonl

Each request is one of: the group's first; sent to the holder (the endpoint credited with
the most blocks, ties broken by the total score); holder filtered out (the filter that
removed it named); holder lost on score. Printed per request: blocks on the holder and on
the chosen endpoint, predicted TTFT on each (queue + uncached, the picker's own terms), the
real TTFT with the engine's parts (lane wait, prefill), and for the repeats whose holder
held more than the group's system part (`--strong` blocks, 50 by default: the system part
is 38-39 of ~90 blocks), the holder's and the chosen endpoint's real backlog at the
decision (the latest first token of a request sent there before, less the decision time;
the simulator's lane batches prefills, so it is approximate) against the predicted queue.
A summary per kind closes it.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

TTFT = "default/predicted-ttft-scorer"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _backlog(rows: list[dict], addr: str, at: float) -> float:
    ends = [
        r["sent_s"] + r["ttft_s"] for r in rows
        if r.get("served_by") == addr and "ttft_s" in r and r["sent_s"] < at
    ]  # fmt: skip
    return max(0.0, max(ends, default=0.0) - at)


def classify(rows: list[dict]) -> list[dict]:
    """One entry per decided request, in send order, with its kind and the terms."""
    out = []
    seen: set[int] = set()
    for r in rows:
        d = r.get("decision")
        if not d or "ttft_s" not in r:
            continue
        held, total = d["prefix_blocks"], d["scores"].get("default/total", {})
        best = max(held.values(), default=0)
        holders = [a for a, n in held.items() if n == best and n > 0]
        holder = max(holders, key=lambda a: total.get(a, -1.0)) if holders else None
        chosen = r["served_by"]
        if r["group"] not in seen or holder is None:
            kind, why = "first" if r["group"] not in seen else "no holder", ""
        elif chosen == holder:
            kind, why = "holder", ""
        elif holder not in total:
            port = holder.rsplit(":", 1)[-1]
            reasons = [x for x in d.get("reasons", []) if port in x]
            kind = "filtered"
            why = reasons[0].split("/")[-1].split(" removed")[0] if reasons else "?"
        else:
            kind, why = "score", ""
        seen.add(r["group"])
        terms = d.get("terms", {}).get(TTFT, {})
        h, c = terms.get(holder or "", {}), terms.get(chosen, {})
        parts = r.get("engine_parts", {})
        out.append({
            "index": r["index"], "t": r["sent_s"], "group": r["group"], "kind": kind,
            "why": why, "holder": holder, "chosen": chosen,
            "holder_blocks": held.get(holder or "", 0), "chosen_blocks": held.get(chosen, 0),
            "blocks": d["request_blocks"],
            "holder_pred": h.get("predicted_s"), "holder_queue": h.get("queue_s"),
            "chosen_pred": c.get("predicted_s"), "chosen_queue": c.get("queue_s"),
            "chosen_uncached": c.get("uncached_s"), "ttft": r["ttft_s"],
            "lane": parts.get("lane_wait_s", 0.0), "prefill": parts.get("prefill_s", 0.0),
            "prompt": r.get("prompt_tokens", 0), "cached": r.get("cached_tokens", 0),
            "estimate": d.get("prompt_tokens", 0),
        })  # fmt: skip
    return out


def report(rows: list[dict], strong: int) -> list[str]:
    rows = sorted(rows, key=lambda r: r["sent_s"])
    es = classify(rows)
    lines = [
        "#idx t group kind holder/chosen/request blocks | predicted holder (queue) | "
        "predicted chosen (queue + uncached) | real TTFT (lane wait, prefill) | cached/prompt"
    ]
    for e in es:
        line = (
            f"#{e['index']} {e['t']:.2f} g{e['group']} {e['kind']}"
            f"{' (' + e['why'] + ')' if e['why'] else ''} "
            f"{e['holder_blocks']:g}/{e['chosen_blocks']:g}/{e['blocks']} | "
            f"{_fmt(e['holder_pred'])} ({_fmt(e['holder_queue'])}) | "
            f"{_fmt(e['chosen_pred'])} ({_fmt(e['chosen_queue'])} + "
            f"{_fmt(e['chosen_uncached'])}) | {e['ttft']:.2f} ({e['lane']:.2f}, "
            f"{e['prefill']:.2f}) | {e['cached']}/{e['prompt']}"
        )
        if e["kind"] in ("score", "filtered", "holder") and e["holder_blocks"] >= strong:
            line += (
                f"\n      real backlog: holder {_backlog(rows, e['holder'], e['t']):.2f}, "
                f"chosen {_backlog(rows, e['chosen'], e['t']):.2f}"
            )
        lines.append(line)
    for kind in ("first", "holder", "filtered", "score", "no holder"):
        ks = [e for e in es if e["kind"] == kind]
        if not ks:
            continue
        strong_n = sum(e["holder_blocks"] >= strong for e in ks)
        hit = sum(e["cached"] for e in ks) / max(1, sum(e["prompt"] for e in ks))
        whys = sorted({e["why"] for e in ks if e["why"]})

        def med(key: str, ks: list[dict] = ks) -> str:
            xs = [e[key] for e in ks if e[key] is not None]
            return _fmt(statistics.median(xs)) if xs else "-"

        lines.append(
            f"{kind}: {len(ks)} ({strong_n} with {strong}+ blocks on the holder"
            f"{', by ' + ', '.join(whys) if whys else ''}), hit {hit:.0%}, real TTFT median "
            f"{med('ttft')} (lane wait {med('lane')}, prefill {med('prefill')}), predicted "
            f"median on the holder {med('holder_pred')}, on the chosen {med('chosen_pred')}"
        )
    est = [e["estimate"] / e["prompt"] for e in es if e["prompt"]]
    if est:
        lines.append(
            f"picker's token estimate / engine's count, median {statistics.median(est):.2f}"
        )
    return lines


def main(argv: list[str]) -> int:
    strong = 50
    if argv[:1] == ["--strong"]:
        strong, argv = int(argv[1]), argv[2:]
    for path in argv:
        rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line]
        print(path)
        print("\n".join(report(rows, strong)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
