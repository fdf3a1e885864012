"""A per-interval timeline of an overload run: what the picker held and released, and what
the engines ran, side by side, to find where capacity went unused.

Sampled from a background thread while the burst runs (the pickers' and sims' /metrics):
per sample the detector's saturation, requests queued in the picker per band, requests
dispatched since the last sample per band, per picker its bytes per token and engine-blocks
ratio, and per engine its running and waiting requests and KV use. `summary()` condenses
the burst window into the figures that tell the causes apart: the engines' mean KV use (a
fleet kept full sits near 1.0), how often batch work waited in the picker while KV use was
below 90% (a conservative detector or a slow release), and the engines' own waiting queues
(work released into engines that are already full).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx


def scrape(
    url: str, client: httpx.Client | None = None, timeout_s: float = 5.0
) -> dict[str, float]:
    """A Prometheus text page as {series: value} (labels kept verbatim)."""
    get = client.get if client is not None else httpx.get
    out: dict[str, float] = {}
    for line in get(url, timeout=timeout_s).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out


def summed(page: dict[str, float], name: str, *needles: str) -> float:
    """The sum of `name`'s series whose labels hold every one of `needles`."""
    return sum(
        v for k, v in page.items()
        if k.partition("{")[0] == name and all(n in k for n in needles)
    )  # fmt: skip


class Timeline:
    """Samples every `every_s` until `stop()`; rows in `rows`, also written to `path`."""

    def __init__(
        self, picker_admins: list[int], sims: list[str], path: Path, every_s: float = 0.5
    ) -> None:
        self.picker_urls = [f"http://127.0.0.1:{p}/metrics" for p in picker_admins]
        self.sim_urls = [f"http://{a}/metrics" for a in sims]
        self.path = path
        self.every_s = every_s
        self.rows: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timeline", daemon=True)

    def start(self) -> Timeline:
        self._thread.start()
        return self

    def stop(self) -> list[dict]:
        self._stop.set()
        self._thread.join(timeout=10)
        with self.path.open("w") as f:
            for row in self.rows:
                f.write(json.dumps(row) + "\n")
        return self.rows

    def _run(self) -> None:
        t0 = time.monotonic()
        last: dict[str, float] = {}
        with httpx.Client() as client:
            while not self._stop.is_set():
                at = time.monotonic() - t0
                try:
                    row = self._sample(client, at, last)
                except httpx.HTTPError:
                    row = {"t": round(at, 2), "error": "scrape failed"}
                self.rows.append(row)
                self._stop.wait(max(0.0, t0 + len(self.rows) * self.every_s - time.monotonic()))

    def _sample(self, client: httpx.Client, at: float, last: dict[str, float]) -> dict:
        row: dict = {"t": round(at, 2)}
        pages = [scrape(u, client, 2.0) for u in self.picker_urls]
        row["saturation"] = round(
            max((summed(p, "extproc_flow_saturation") for p in pages), default=0.0), 3
        )
        for band, label in (("10", "hi"), ("0", "lo")):
            sel = f'priority="{band}"'
            queued = sum(summed(p, "extproc_flow_queue_requests", sel) for p in pages)
            row[f"queued_{label}"] = int(queued)
            done = sum(
                summed(p, "extproc_flow_requests_total", sel, 'outcome="dispatched"') for p in pages
            )
            row[f"released_{label}"] = int(done - last.get(label, 0.0))
            last[label] = done
        row["inflight_tokens"] = int(sum(summed(p, "extproc_inflight_tokens") for p in pages))
        # Dispatch opportunities with room on average but none on any endpoint, and the
        # room kept for higher bands (per-endpoint admission).
        no_room = sum(summed(p, "extproc_flow_no_endpoint_room_total") for p in pages)
        row["no_room"] = int(no_room - last.get("no_room", 0.0))
        last["no_room"] = no_room
        # ... of which the reserve kept (an endpoint had room but not with the reserve) or
        # the prefill gate held; the rest: no endpoint under the ceiling with the request.
        # `claims`: a waiting interactive request kept its server (waiting_claims_room).
        for key, name in (("reserve_held", "extproc_flow_reserve_held_total"),
                          ("gate_held", "extproc_flow_prefill_gate_held_total"),
                          ("claims", "extproc_flow_room_claims_total")):  # fmt: skip
            total = sum(summed(p, name) for p in pages)
            row[key] = int(total - last.get(key, 0.0))
            last[key] = total
        row["reserved"] = int(max((summed(p, "extproc_flow_reserved_tokens") for p in pages),
                                  default=0.0))  # fmt: skip
        # Each picker's own (two replicas size theirs apart: bench/overload_rival.py).
        # Free capacity left to the other replica (fleet-wide fairness), per band.
        for band, label in (("10", "hi"), ("0", "lo")):
            name = f"defer_{label}"
            total = sum(
                summed(p, "extproc_flow_peer_deferrals_total", f'priority="{band}"') for p in pages
            )
            row[name] = int(total - last.get(name, 0.0))
            last[name] = total
        row["reserved_each"] = [int(summed(p, "extproc_flow_reserved_tokens")) for p in pages]
        row["refill_each"] = [int(summed(p, "extproc_flow_reserve_refill_tokens")) for p in pages]
        # ... of which an endpoint was let keep less: room it frees soon (reserve_refill_s).
        row["refill"] = int(max((summed(p, "extproc_flow_reserve_refill_tokens") for p in pages),
                                default=0.0))  # fmt: skip
        # The unit outputs are counted in (output_token_scale), and how many pickers have
        # not measured it (`auto`: calibration's first window not closed; or configured).
        row["out_scale"] = round(
            max((summed(p, "extproc_flow_output_token_scale") for p in pages), default=0.0), 3
        )
        row["out_scale_unmeasured"] = sum(
            1
            for p in pages
            if not summed(p, "extproc_flow_output_token_scale", 'source="measured"')
        )
        # Per picker, the estimate's unit and what count_engine_blocks converts it with: a
        # bytes-per-token change of calibration (flow control's ratios follow it) or a swing
        # of the measured ratio shows at the sample it happened (0: not exported there).
        row["bpt_each"] = [summed(p, "extproc_approx_bytes_per_token") for p in pages]
        row["eb_ratio_each"] = [
            round(summed(p, "extproc_flow_engine_blocks_ratio"), 4) for p in pages
        ]
        # Each picker's calibration windows: engine prompt tokens per estimate in each
        # endpoint's last one (the sim's tokenizer reads ~0.78 at 1 byte a token); a pairing
        # that drifts shows as a swing of these.
        row["ratio_each"] = [
            [round(v, 3) for k, v in sorted(p.items())
             if k.partition("{")[0] == "extproc_approx_token_ratio"]
            for p in pages
        ]  # fmt: skip
        for i, url in enumerate(self.sim_urls):
            s = scrape(url, client, 2.0)
            row[f"run{i}"] = int(summed(s, "vllm:num_requests_running"))
            row[f"wait{i}"] = int(summed(s, "vllm:num_requests_waiting"))
            row[f"kv{i}"] = round(summed(s, "vllm:kv_cache_usage_perc"), 3)
            # The prefill gate's unfinished tokens there (its last judgement): a count of
            # requests in prefill that overstates holds batch back (bench/RESULTS.md, issue
            # 15, thirty-first session: cuts before a first token).
            address = url.removeprefix("http://").partition("/")[0]
            row[f"unf{i}"] = int(
                max(
                    (
                        summed(p, "extproc_flow_prefill_gate_unfinished_tokens", address)
                        for p in pages
                    ),
                    default=0.0,
                )
            )
        return row


def summary(rows: list[dict], start_s: float, end_s: float, servers: int) -> dict:
    """The burst window [start_s, end_s] of a timeline in a few figures."""
    win = [r for r in rows if "error" not in r and start_s <= r["t"] <= end_s]
    if not win:
        return {}
    n = len(win)
    kv = [sum(r[f"kv{i}"] for i in range(servers)) / servers for r in win]
    ratios = [x for r in win for each in r.get("ratio_each", ()) for x in each]
    return {
        "tl_samples": n,
        "tl_kv_mean": round(sum(kv) / n, 3),
        "tl_running_mean": round(sum(r[f"run{i}"] for r in win for i in range(servers)) / n, 1),
        "tl_engine_waiting_mean": round(
            sum(r[f"wait{i}"] for r in win for i in range(servers)) / n, 2
        ),
        "tl_saturation_mean": round(sum(r["saturation"] for r in win) / n, 3),
        # The prefill gate's unfinished tokens per server (0 without the gate).
        "tl_gate_unfinished_mean": round(
            sum(r.get(f"unf{i}", 0) for r in win for i in range(servers)) / n / servers
        ),
        "tl_queued_lo_mean": round(sum(r["queued_lo"] for r in win) / n, 1),
        "tl_queued_hi_mean": round(sum(r["queued_hi"] for r in win) / n, 2),
        # The room kept for higher bands, and how much less a server soon to free it kept.
        "tl_reserved_mean": round(sum(r.get("reserved", 0) for r in win) / n),
        "tl_refill_mean": round(sum(r.get("refill", 0) for r in win) / n),
        # Why queued work stayed queued, per second of the window: no endpoint had room
        # (all causes), of which the reserve kept it, or the prefill gate held it.
        **{
            f"tl_{k}_per_s": round(sum(r.get(k, 0) for r in win) / max(1e-9, end_s - start_s), 1)
            for k in ("no_room", "reserve_held", "gate_held", "claims")
        },
        # output_token_scale at the window's end, and when every picker had measured it,
        # in seconds from the window's start (`auto`; None: never, or configured).
        "tl_out_scale": win[-1].get("out_scale"),
        "tl_out_scale_measured_t": next(
            (round(r["t"] - start_s, 1) for r in rows if r.get("out_scale_unmeasured", -1) == 0),
            None,
        ),
        # Capacity unused while work waited in the picker.
        "tl_idle_while_queued": round(
            sum(1 for r, k in zip(win, kv, strict=True) if r["queued_lo"] and k < 0.9) / n, 3
        ),
        # Calibration's windows over the burst, every picker and endpoint: the lowest and
        # highest engine tokens per estimate read, and every bytes-per-token held.
        "tl_token_ratio_range": [min(ratios), max(ratios)] if ratios else None,
        "tl_bytes_per_token": sorted({b for r in win for b in r.get("bpt_each", ())}),
    }
