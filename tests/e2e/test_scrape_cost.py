"""Scraping in `extproc serve` against simulated vLLM servers, behind Envoy: connections are
kept alive across scrapes, an idle server's unchanged body is not parsed again, and the cost
is exported (extproc_scrape_* on the picker's /metrics)."""

from __future__ import annotations

import re
import time

import httpx

from extproc.stack import Stack, StackOptions


def counters(admin: str) -> dict[str, float]:
    text = httpx.get(f"{admin}/metrics", timeout=5).text
    out = {}
    for name in (
        "extproc_scrapes_total",
        "extproc_scrape_unchanged_total",
        "extproc_scrape_parse_cpu_seconds_total",
        "extproc_scrape_connections_total",
    ):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        assert m, f"{name} not exported"
        out[name] = float(m.group(1))
    return out


def test_idle_servers_are_scraped_on_kept_connections_without_reparsing():
    with Stack(StackOptions(upstreams=2, sim_args=())) as stack:
        body = {"model": stack.fleet.model, "prompt": "hello there " * 20, "max_tokens": 2}
        r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        admin = f"http://127.0.0.1:{stack.picker_admin_port}"
        first = counters(admin)
        deadline = time.monotonic() + 30
        now = first
        while time.monotonic() < deadline:
            now = counters(admin)
            if (
                now["extproc_scrapes_total"] - first["extproc_scrapes_total"] >= 40
                and now["extproc_scrape_unchanged_total"] > first["extproc_scrape_unchanged_total"]
            ):
                break
            time.sleep(0.2)
        scrapes = now["extproc_scrapes_total"] - first["extproc_scrapes_total"]
        assert scrapes >= 40, now
        # Idle servers repeat their body: those scrapes were hashed, not parsed.
        assert now["extproc_scrape_unchanged_total"] > first["extproc_scrape_unchanged_total"]
        # One connection per server, not one per scrape.
        assert now["extproc_scrape_connections_total"] <= 4, now
        assert now["extproc_scrape_parse_cpu_seconds_total"] > 0
