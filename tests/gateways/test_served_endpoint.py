"""Behind Istio-style settings (override_host with `selected_host_key`, ext_proc forwarding
`envoy.lb`), a pick that cannot be served is retried on the picker's fallback, and the picker
hears which endpoint really served: its in-flight count follows the served one."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from extproc.bootstrap import BootstrapOptions
from extproc.gateways import ISTIO, gateway_bootstrap
from extproc.sim import echo
from extproc.stack import Stack, StackOptions, free_port, wait_until

pytestmark = pytest.mark.e2e


def metric(stack: Stack, name: str) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{stack.picker_admin_port}/metrics").text
    out = {}
    for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M):
        out[m.group(1) or ""] = float(m.group(2))
    return out


def test_served_endpoint_takes_over_when_the_pick_is_dead(tmp_path: Path):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: connect-failure, then the fallback
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text(yaml.safe_dump([dead]))
    config = tmp_path / "picker.yaml"
    # No scraping: the dead endpoint stays eligible, as a server that just died would be.
    config.write_text(yaml.safe_dump({"state": {"scrape": None}}))

    def bootstrap(opts: BootstrapOptions):
        return gateway_bootstrap(ISTIO, replace(opts, endpoints=(*opts.endpoints, dead)))

    opts = StackOptions(
        upstreams=1,
        lb="override-host",
        fallbacks=1,
        bootstrap=bootstrap,
        extproc_args=("--endpoints-file", str(endpoints), "--config", str(config)),
    )
    with Stack(opts) as stack:
        (live,) = stack.upstream_addresses
        endpoints.write_text(yaml.safe_dump([dead, live]))
        wait_until(
            lambda: metric(stack, "extproc_endpoints").get("") == 2, timeout_s=30, what="pool"
        )
        served_elsewhere = 0.0
        with httpx.Client(base_url=stack.url, timeout=30) as c:
            for i in range(12):
                if served_elsewhere >= 2:
                    break
                # The previous answer counts until its end arrives (the access log's batch):
                # read mid-answer counts only once it has.
                wait_until(
                    lambda: sum(metric(stack, "extproc_inflight_requests").values()) == 0,
                    timeout_s=30,
                    what="the previous request released",
                )
                body = orjson.dumps({"model": "m", "prompt": f"request {i} " * 50})
                with c.stream(
                    "POST",
                    "/v1/completions",
                    content=body,
                    # 2 s of answer: time to look at the counts mid-answer, even on a
                    # loaded machine.
                    headers={echo.CHUNKS_HEADER: "20", echo.CHUNK_GAP_HEADER: "100"},
                ) as r:
                    assert r.status_code == 200
                    it = r.iter_raw()
                    payload = orjson.loads(next(it).split(b"\n", 1)[0])
                    assert payload["endpoint"] == live
                    now = metric(stack, "extproc_served_elsewhere_total").get("", 0.0)
                    if now > served_elsewhere:
                        # Mid-answer: the request counts on the server that serves it.
                        inflight = metric(stack, "extproc_inflight_requests")
                        assert inflight.get(f'{{endpoint="{live}"}}') == 1
                        assert inflight.get(f'{{endpoint="{dead}"}}', 0) == 0
                        served_elsewhere = now
                    b"".join(it)
        assert served_elsewhere >= 2  # picks went to the dead one and were walked past
        wait_until(
            lambda: sum(metric(stack, "extproc_inflight_requests").values()) == 0,
            timeout_s=30,
            what="in-flight released",
        )
