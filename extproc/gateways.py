"""How each real gateway configures ext_proc, as data, and the Envoy bootstrap that reproduces
it in front of a picker.

One row per gateway (`GATEWAYS`), each citing the project, version and file its values were
read from (docs/gateways.md prints the same table). `gateway_bootstrap` starts from our own
bootstrap and swaps in the gateway's ext_proc filter, picker cluster and model-server routing,
so the only differences are the ones the table states. Used by the gateway matrix in
tests/gateways/.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any, Literal

from extproc import protocol
from extproc.bootstrap import BootstrapOptions, build_bootstrap

Mode = Literal["NONE", "STREAMED", "BUFFERED", "BUFFERED_PARTIAL", "FULL_DUPLEX_STREAMED"]
Routing = Literal["original-dst", "override-host"]

_T = "type.googleapis.com/envoy.extensions"
_UNLIMITED = 4_294_967_295  # Istio's default circuit-breaker thresholds (max uint32)


@dataclass(frozen=True, slots=True)
class Gateway:
    """One gateway's ext_proc settings. `None` for a timeout means the gateway leaves it unset
    (Envoy's default). `source`: project, version, file the values come from."""

    name: str
    title: str
    source: str
    request_body: Mode
    response_body: Mode
    request_trailers: bool
    response_trailers: bool
    message_timeout_s: float | None
    grpc_timeout_s: float | None
    failure_mode_allow: bool
    allow_mode_override: bool
    receive_lb: bool  # metadata_options.receiving_namespaces has envoy.lb
    forward_lb: bool  # metadata_options.forwarding_namespaces has envoy.lb
    tls: bool  # TLS to the picker, certificate not verified
    routing: Routing
    served_key: bool  # override_host reports the served endpoint (selected_host_key)
    health_service: str | None  # Envoy's gRPC health check of the picker, if any
    health_interval_s: float
    picker_limit: int | None  # circuit breakers on the picker cluster (None: Envoy's 1024)
    model_limit: int | None  # circuit breakers on the model-server cluster
    route_timeout_s: float | None  # 0 disables; None leaves Envoy's 15 s default


ISTIO = Gateway(
    name="istio",
    title="Istio 1.30 native InferencePool",
    source="istio/istio 1.30.3: pilot/pkg/xds/filters/filters.go, "
    "pilot/pkg/networking/core/route/route.go",
    request_body="FULL_DUPLEX_STREAMED",
    response_body="FULL_DUPLEX_STREAMED",
    request_trailers=True,
    response_trailers=True,
    message_timeout_s=1000,
    grpc_timeout_s=10,
    failure_mode_allow=False,  # InferencePool failureMode, CRD default FailClose
    allow_mode_override=False,
    receive_lb=True,
    forward_lb=True,
    tls=True,  # DestinationRule; GIE's chart sets TLS SIMPLE
    routing="override-host",
    served_key=True,
    health_service=None,
    health_interval_s=0,
    picker_limit=_UNLIMITED,
    model_limit=_UNLIMITED,
    route_timeout_s=0,  # HTTPRoute without `timeouts`: none
)

AI_GATEWAY = Gateway(
    name="aigw",
    title="Envoy AI Gateway (default)",
    source="envoyproxy/ai-gateway HEAD (Aug 2026): internal/extensionserver/inferencepool.go",
    request_body="FULL_DUPLEX_STREAMED",
    response_body="FULL_DUPLEX_STREAMED",
    request_trailers=True,
    response_trailers=True,
    message_timeout_s=300,
    grpc_timeout_s=None,
    failure_mode_allow=False,
    allow_mode_override=False,
    receive_lb=False,
    forward_lb=False,
    tls=True,  # always, certificate not verified
    routing="original-dst",  # Envoy Gateway: the destination header
    served_key=False,
    health_service=None,
    health_interval_s=0,
    picker_limit=None,
    model_limit=None,
    route_timeout_s=None,
)

AI_GATEWAY_BUFFERED = replace(
    AI_GATEWAY,
    name="aigw-buffered",
    title="Envoy AI Gateway, BUFFERED annotation",
    source=AI_GATEWAY.source + " (processing-body-mode annotation)",
    request_body="BUFFERED",
    allow_mode_override=True,  # the annotation that allows it; Envoy still ignores it here
)

LLM_D = Gateway(
    name="llm-d",
    title="llm-d standalone Envoy chart",
    source="llm-d/llm-d-router HEAD: config/charts/llm-d-router-standalone/values.yaml, "
    "config/charts/routerlib/templates/_helpers.tpl",
    request_body="FULL_DUPLEX_STREAMED",
    response_body="FULL_DUPLEX_STREAMED",
    request_trailers=True,
    response_trailers=True,
    message_timeout_s=1000,
    grpc_timeout_s=10,
    failure_mode_allow=True,  # chart value; the guides set FailOpen
    allow_mode_override=False,
    receive_lb=False,
    forward_lb=False,
    tls=True,  # secure-serving defaults to true; empty validation context
    routing="original-dst",
    served_key=False,
    health_service=protocol.EXT_PROC_SERVICE,
    health_interval_s=10,
    picker_limit=40_000,
    model_limit=40_000,
    route_timeout_s=86_400,
)


def ours(opts: BootstrapOptions) -> dict[str, Any]:
    """`extproc envoy-config` itself."""
    return build_bootstrap(opts)


GATEWAYS: tuple[Gateway, ...] = (ISTIO, AI_GATEWAY, AI_GATEWAY_BUFFERED, LLM_D)


def _seconds(s: float) -> str:
    return f"{s:g}s"


def _filter(gw: Gateway) -> dict[str, Any]:
    grpc: dict[str, Any] = {"envoy_grpc": {"cluster_name": "extproc"}}
    if gw.grpc_timeout_s is not None:
        grpc["timeout"] = _seconds(gw.grpc_timeout_s)
    cfg: dict[str, Any] = {
        "@type": f"{_T}.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": grpc,
        "failure_mode_allow": gw.failure_mode_allow,
        "allow_mode_override": gw.allow_mode_override,
        "processing_mode": {
            "request_header_mode": "SEND",
            "response_header_mode": "SEND",
            "request_body_mode": gw.request_body,
            "response_body_mode": gw.response_body,
            "request_trailer_mode": "SEND" if gw.request_trailers else "SKIP",
            "response_trailer_mode": "SEND" if gw.response_trailers else "SKIP",
        },
    }
    if gw.message_timeout_s is not None:
        cfg["message_timeout"] = _seconds(gw.message_timeout_s)
    options: dict[str, Any] = {}
    if gw.receive_lb:
        options["receiving_namespaces"] = {"untyped": [protocol.LB_NAMESPACE]}
    if gw.forward_lb:
        options["forwarding_namespaces"] = {"untyped": [protocol.LB_NAMESPACE]}
    if options:
        cfg["metadata_options"] = options
    return {"name": "envoy.filters.http.ext_proc", "typed_config": cfg}


def _limits(n: int) -> dict[str, Any]:
    return {
        "thresholds": [
            {"max_connections": n, "max_pending_requests": n, "max_requests": n, "max_retries": n}
        ]
    }


def gateway_bootstrap(gw: Gateway, opts: BootstrapOptions) -> dict[str, Any]:
    """Our bootstrap for `opts` with `gw`'s ext_proc filter, picker cluster and routing."""
    lb = "override-host" if gw.routing == "override-host" else "original-dst"
    base = replace(opts, lb=lb, fail_open=False, extproc_tls=gw.tls, retries=2)
    doc = copy.deepcopy(build_bootstrap(base))
    res = doc["static_resources"]
    hcm = res["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [
        _filter(gw) if f["name"] == "envoy.filters.http.ext_proc" else f
        for f in hcm["http_filters"]
    ]
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    if gw.route_timeout_s is None:
        route.pop("timeout", None)
    else:
        route["timeout"] = _seconds(gw.route_timeout_s)
    if gw.routing == "override-host":
        # Istio's default retry policy; override_host walks the picker's list on retries.
        route["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream,unavailable,cancelled",
            "num_retries": 2,
        }
    else:
        route.pop("retry_policy", None)
    model, picker = res["clusters"]
    if gw.model_limit is None:
        model.pop("circuit_breakers", None)
    else:
        model["circuit_breakers"] = _limits(gw.model_limit)
    if gw.routing == "override-host" and not gw.served_key:
        policy = model["load_balancing_policy"]["policies"][0]["typed_extension_config"]
        policy["typed_config"].pop("selected_host_key", None)
    if gw.picker_limit is None:
        picker.pop("circuit_breakers", None)
    else:
        picker["circuit_breakers"] = _limits(gw.picker_limit)
    picker.pop("common_lb_config", None)
    if gw.health_service is None:
        picker.pop("health_checks", None)
    else:
        picker["health_checks"] = [
            {
                "timeout": "2s",
                "interval": _seconds(gw.health_interval_s),
                "unhealthy_threshold": 3,
                "healthy_threshold": 2,
                "reuse_connection": True,
                "grpc_health_check": {"service_name": gw.health_service},
            }
        ]
    if gw.tls:
        # The gateways do not verify the picker's certificate (no validation context).
        tls = picker["transport_socket"]["typed_config"]["common_tls_context"]
        tls.pop("validation_context", None)
    return doc
