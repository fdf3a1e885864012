"""The Istio EnvoyFilter overlay run for real: its filters and route patch applied to a real
Envoy with a second, unrelated route. The picker (TLS, as the overlay's DestinationRule
connects) decides the inference route only; the other route never meets it, not even when
the picker is down (fail closed applies to inference traffic alone)."""

from __future__ import annotations

import copy
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from extproc.bootstrap import BootstrapOptions, build_bootstrap
from extproc.stack import Stack, StackOptions

pytestmark = pytest.mark.e2e

EF = Path(__file__).resolve().parents[2] / "deploy/overlays/istio/envoyfilter/envoyfilter.yaml"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "scoped"}]}


def patches(kind: str) -> list[dict[str, Any]]:
    doc = yaml.safe_load(EF.read_text())
    return [p for p in doc["spec"]["configPatches"] if p["applyTo"] == kind]


def with_envoyfilter(opts: BootstrapOptions) -> dict[str, Any]:
    """Our bootstrap with the EnvoyFilter's HTTP filters, its route patch on `/v1/` (the
    `llm` route) and a plain route `/` to the first upstream, as a shared gateway has."""
    doc = build_bootstrap(opts)
    res = doc["static_resources"]
    hcm = res["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    added = [copy.deepcopy(p["patch"]["value"]) for p in patches("HTTP_FILTER")]
    added[1]["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = "extproc"
    hcm["http_filters"] = [*added, hcm["http_filters"][-1]]
    (route_patch,) = patches("HTTP_ROUTE")
    llm = copy.deepcopy(route_patch["patch"]["value"])
    llm["route"]["cluster"] = "model_servers"
    hcm["route_config"]["virtual_hosts"][0]["routes"] = [
        {"name": "llm", "match": {"prefix": "/v1/"}, **llm},
        {"name": "other", "match": {"prefix": "/"}, "route": {"cluster": "plain"}},
    ]
    host, port = opts.endpoints[0].rsplit(":", 1)
    res["clusters"].append(
        {
            "name": "plain",
            "type": "STATIC",
            "connect_timeout": "2s",
            "load_assignment": {
                "cluster_name": "plain",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {
                                        "socket_address": {"address": host, "port_value": int(port)}
                                    }
                                }
                            }
                        ]
                    }
                ],
            },
        }
    )
    return doc


def test_envoyfilter_puts_the_picker_on_the_inference_route_only():
    with (
        Stack(StackOptions(upstreams=2, bootstrap=with_envoyfilter)) as stack,
        httpx.Client(base_url=stack.url, timeout=30) as c,
    ):
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        assert r.json()["destination_header"] in stack.upstream_addresses  # the picker chose
        r = c.get("/healthz")
        assert r.status_code == 200 and r.json()["destination_header"] is None
        stack.stop_extproc(signal.SIGKILL)
        assert c.get("/healthz").status_code == 200  # untouched by the picker's outage
        assert c.post("/v1/chat/completions", json=CHAT).status_code >= 500  # fail closed
