"""Envoy bootstrap for a picker: the listener, the ext_proc filter configured the way the
endpoint-picker protocol needs, and the model-server cluster that obeys the decision.

Two ways to obey it:
- `original-dst`: an ORIGINAL_DST cluster keyed by the destination header. Any ip:port, no
  endpoint list in Envoy; exactly one address per request (no fallbacks).
- `override-host`: a STATIC cluster of the known endpoints with the override_host load
  balancing policy, which reads the header or `envoy.lb` metadata, accepts an ordered list and
  walks it on retries (the route's retry policy).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

from extproc import protocol

LbMode = Literal["original-dst", "override-host"]
BodyMode = Literal["FULL_DUPLEX_STREAMED", "BUFFERED"]
ResponseHeaders = Literal["auto", "send", "skip"]
ResponseTrailers = Literal["skip", "send"]

_T = "type.googleapis.com/envoy.extensions"


@dataclass(frozen=True, slots=True)
class BootstrapOptions:
    """Inputs of `extproc envoy-config`. `extproc` is the picker's `host:port`;
    `endpoints` (ip:port) are required for override-host, unused for original-dst.
    `extproc_tls` (default on, as the picker's port): speak TLS to the picker, sending
    `extproc_sni` (default: the picker's host name); the certificate is verified against
    `extproc_ca_file` when given, else not at all (a self-signed picker's certificate changes
    at every start). Off only for a picker started with `--plaintext`."""

    listen_port: int = 8081
    listen_address: str = "0.0.0.0"
    extproc: str = "127.0.0.1:9002"
    lb: LbMode = "original-dst"
    endpoints: Sequence[str] = field(default_factory=tuple)
    admin_port: int | None = None
    fail_open: bool = False
    retries: int = 2
    max_retries: int = 1024  # concurrent retries Envoy allows on the model-server cluster
    route_timeout_s: float = 3600.0
    extproc_timeout_s: float = 30.0
    health_interval_s: float = 1.0
    extproc_tls: bool = True  # the picker serves TLS unless started with --plaintext
    extproc_sni: str | None = None
    extproc_ca_file: str | None = None
    # Envoy's gRPC access log to the picker: tells it when each request really ended, so
    # in-flight counts cover the whole streamed reply (response bodies are not sent to it).
    access_log: bool = True
    # How late the picker may hear of an end, and so how long queued work may wait for the
    # room it freed: 20 ms, not Envoy's usual 1 s or our earlier 0.1 s. In the overload
    # bench fewer interactive requests went above 2x unloaded TTFT at 20 ms than at 0.1 s
    # (4 of 6 pairs fewer, none more), at no CPU measurable per request (bench/RESULTS.md,
    # eighteenth session); batches still flush early when `buffer_size_bytes` fills.
    access_log_flush_s: float = 0.02
    # More picker replicas (host:port) in the picker cluster, balanced with `extproc`.
    extproc_replicas: Sequence[str] = ()
    # Sized like production (see docs/gateways.md for what the gateways use):
    message_timeout_s: float = 30.0
    concurrency_limit: int = 40_000
    per_try_idle_timeout_s: float = 60.0
    # Pass `x-extproc-explain` / `x-extproc-decision` through the edge (only for a gateway
    # that trusted operators reach; the picker also needs `server.explain_tokens`).
    allow_explain: bool = False
    # A picker run as `--workers N --worker-ports P` with `extproc` = host:P: one cluster host
    # per worker port (P .. P+N-1), so round robin spreads streams over the processes.
    extproc_workers: int = 1
    # Streams Envoy multiplexes on one connection to a picker before opening another
    # (http2_protocol_options.max_concurrent_streams; Envoy ignores the peer's SETTINGS).
    extproc_streams_per_connection: int = 100
    # How the request body reaches the picker (docs/gateways.md, "The cheapest exchange").
    request_body_mode: BodyMode = "FULL_DUPLEX_STREAMED"
    # Whether Envoy sends the response headers to the picker (docs/gateways.md, "The
    # cheapest exchange"). `send` (default) keeps the phase: response headers the picker
    # adds (session tokens, predicted TTFT), flow control's admission and eviction window
    # (both end with the ext_proc stream). `auto`: skipped when the access log reports each
    # request's end, explanations are off and the request has one possible address
    # (`skips_response_headers`); `skip`: always. Opt-in: the config cannot see the
    # picker's profile.
    response_headers: ResponseHeaders = "send"
    # Whether Envoy sends the response trailers to the picker (docs/flow-control.md,
    # "Eviction"). `skip` (default): the ext_proc stream ends at the response headers, and
    # with it the window in which flow control's eviction can cut a request; a streamed
    # reply's headers come before the engine even schedules it, so nothing running can be
    # cut. `send`: Envoy keeps the stream to the response's end (sending no trailers
    # message when the model server sends none: no message more per request), so eviction
    # cuts a response under way (Envoy resets it, the engine aborts it); the picker ends the
    # stream of a request it cannot cut at its headers (bench/RESULTS.md, issue 15,
    # twenty-ninth session). Needs the response-header phase (`auto` then keeps it).
    response_trailers: ResponseTrailers = "skip"


def _split_host_port(hostport: str) -> tuple[str, int]:
    host, _, port = hostport.rpartition(":")
    return host.strip("[]"), int(port)


def _socket(hostport: str) -> dict[str, Any]:
    host, port = _split_host_port(hostport)
    return {"socket_address": {"address": host, "port_value": port}}


def _ext_proc_filter(opts: BootstrapOptions) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": f"{_T}.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {
                "envoy_grpc": {"cluster_name": "extproc"},
                # Deadline to open the stream to the picker; a picker that cannot take a
                # stream in this long is down (health checks then route around it).
                "timeout": f"{opts.extproc_timeout_s}s",
            },
            # Per reply on header/buffered messages. Envoy's 200 ms default turned a 1 s
            # picker stall (GC, CPU starvation) into 504s for requests already served;
            # the gateways use 300-1000 s. 30 s outlasts any stall yet bounds a hung picker.
            "message_timeout": f"{opts.message_timeout_s}s",
            "failure_mode_allow": opts.fail_open,
            "processing_mode": {
                "request_header_mode": "SEND",
                # Response headers are observed (status, served endpoint) unless the access
                # log reports them; response bodies are not requested, so the picker's cost
                # does not grow with output length.
                "response_header_mode": "SKIP" if skips_response_headers(opts) else "SEND",
                "request_body_mode": opts.request_body_mode,
                "response_body_mode": "NONE",
                # FULL_DUPLEX_STREAMED is rejected unless the matching trailer mode is SEND.
                "request_trailer_mode": (
                    "SEND" if opts.request_body_mode == "FULL_DUPLEX_STREAMED" else "SKIP"
                ),
                "response_trailer_mode": opts.response_trailers.upper(),
            },
            # Without receiving, the envoy.lb metadata the picker returns is dropped;
            # forwarding hands the picker the served endpoint on the response path
            # (override_host's selected_host_key writes it there).
            "metadata_options": {
                "receiving_namespaces": {"untyped": [protocol.LB_NAMESPACE]},
                "forwarding_namespaces": {"untyped": [protocol.LB_NAMESPACE]},
            },
            "allow_mode_override": False,
        },
    }


def skips_response_headers(opts: BootstrapOptions) -> bool:
    """Whether the generated config leaves the response-header phase out (two of the six
    ext_proc messages per request). `auto` skips only where nothing is lost: the access log
    reports what the phase would have (request end, time to first byte, status, size), no
    explanation is to be returned, and the request cannot be served elsewhere than the
    pick (original-dst, or no retries), so in-flight counts need no correction mid-request.
    Forced `skip` with fallbacks: the index follows the served endpoint when the entry
    comes; the in-flight count stays on the pick until then."""
    if opts.response_trailers == "send":
        if opts.response_headers == "skip":
            raise ValueError(
                "--response-trailers send needs the response-header phase: the picker ends "
                "each request's accounting there (not with --response-headers skip)"
            )
        return False
    if opts.response_headers == "auto":
        one_address = opts.lb == "original-dst" or opts.retries == 0
        return opts.access_log and not opts.allow_explain and one_address
    return opts.response_headers == "skip"


def _picker_tls(opts: BootstrapOptions, host: str) -> dict[str, Any]:
    """The picker cluster's transport socket. ALPN h2: the picker is a gRPC server."""
    common: dict[str, Any] = {"alpn_protocols": ["h2"]}
    if opts.extproc_ca_file is not None:
        common["validation_context"] = {"trusted_ca": {"filename": opts.extproc_ca_file}}
    tls: dict[str, Any] = {
        "@type": f"{_T}.transport_sockets.tls.v3.UpstreamTlsContext",
        "common_tls_context": common,
    }
    sni = opts.extproc_sni or host
    if not _is_ip(sni):
        tls["sni"] = sni  # SNI must be a host name; an IP address is not sent
    return {"name": "envoy.transport_sockets.tls", "typed_config": tls}


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _strip_picker_headers_filter(opts: BootstrapOptions | None = None) -> dict[str, Any]:
    # Runs before ext_proc so a client-sent destination header can never route, even when
    # the picker is skipped (fail-open). Route-level request_headers_to_remove would also
    # remove the picker's own header before host selection (every request would 503).
    mutations: dict[str, Any] = {
        "request_mutations": [{"remove": name} for name in sorted(protocol.PICKER_OWNED_HEADERS)]
    }
    if opts is None or not opts.allow_explain:
        _strip_explanations(mutations)
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": f"{_T}.filters.http.header_mutation.v3.HeaderMutation",
            "mutations": mutations,
        },
    }


def _strip_explanations(mutations: dict[str, Any]) -> None:
    """No decision data crosses the edge: the request never asks for it, and (first filter,
    so last on the way back) any explanation header is removed from the response."""
    mutations["request_mutations"].append({"remove": protocol.EXPLAIN_HEADER})
    mutations["response_mutations"] = [{"remove": protocol.DECISION_HEADER}]


def _policy(name: str, proto: str, **config: Any) -> dict[str, Any]:
    """A load_balancing_policy with one typed extension."""
    typed = {"@type": f"{_T}.load_balancing_policies.{proto}", **config}
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": f"envoy.load_balancing_policies.{name}",
                    "typed_config": typed,
                }
            }
        ]
    }


def _thresholds(opts: BootstrapOptions, *, retries: int) -> dict[str, Any]:
    # Envoy's 1024 connections/pending/requests would silently cap concurrent LLM requests
    # (each lasts seconds to minutes and holds one upstream request AND one picker stream)
    # and 503 the rest. Envoy allows 3 concurrent retries by default; when a server dies with
    # more requests on it, the rest would get 503 instead of walking their fallback list.
    n = opts.concurrency_limit
    return {
        "priority": "DEFAULT",
        "max_connections": n,
        "max_pending_requests": n,
        "max_requests": n,
        "max_retries": retries,
    }


def _model_cluster(opts: BootstrapOptions) -> dict[str, Any]:
    base: dict[str, Any] = {
        "name": "model_servers",
        "connect_timeout": "5s",
        "circuit_breakers": {"thresholds": [_thresholds(opts, retries=opts.max_retries)]},
    }
    if opts.lb == "original-dst":
        base.update(
            {
                "type": "ORIGINAL_DST",
                "lb_policy": "CLUSTER_PROVIDED",
                "original_dst_lb_config": {
                    "use_http_header": True,
                    "http_header_name": protocol.DESTINATION_HEADER,
                },
            }
        )
        return base
    if not opts.endpoints:
        raise ValueError("override-host needs the endpoint list: pass --endpoints")
    base.update(
        {
            "type": "STATIC",
            "load_assignment": {
                "cluster_name": "model_servers",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {"endpoint": {"address": _socket(e)}} for e in opts.endpoints
                        ]
                    }
                ],
            },
            "load_balancing_policy": _policy(
                "override_host",
                "override_host.v3.OverrideHost",
                override_host_sources=[
                    {"header": protocol.DESTINATION_HEADER},
                    {
                        "metadata": {
                            "key": protocol.LB_NAMESPACE,
                            "path": [{"key": protocol.DESTINATION_KEY}],
                        }
                    },
                ],
                # Used when the picker gave no host (fail-open, picker skipped).
                fallback_policy=_policy("least_request", "least_request.v3.LeastRequest"),
                # Reports the host that really served (a retry may walk the fallback list)
                # in envoy.lb metadata; ext_proc forwards it to the picker with the response.
                selected_host_key={
                    "key": protocol.LB_NAMESPACE,
                    "path": [{"key": protocol.SERVED_KEY}],
                },
            ),
        }
    )
    return base


def _route(opts: BootstrapOptions) -> dict[str, Any]:
    route: dict[str, Any] = {
        "cluster": "model_servers",
        # Whole request, generation included: long reasoning outputs take minutes.
        "timeout": f"{opts.route_timeout_s}s",
    }
    if opts.retries > 0:
        route["retry_policy"] = {
            # Only failures before any response byte: a request is never sent twice to a
            # server that answered. override_host walks the picker's ordered list one entry
            # per retry; ORIGINAL_DST retries the same address (a restarting server).
            "retry_on": "connect-failure,refused-stream,reset,unavailable",
            "num_retries": opts.retries,
            # A frozen server (no byte for this long, longer than a deep prefill queue) is
            # abandoned and retried instead of holding the request for the route timeout.
            "per_try_idle_timeout": f"{opts.per_try_idle_timeout_s}s",
        }
    return {"match": {"prefix": "/"}, "route": route}


def _access_log(opts: BootstrapOptions) -> dict[str, Any]:
    # Batched: one entry per request whatever its output length, flushed every
    # access_log_flush_s; the picker matches entries to placements by x-request-id.
    return {
        "name": "envoy.access_loggers.http_grpc",
        "typed_config": {
            "@type": f"{_T}.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": "extproc-request-end",
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": "extproc"}},
                "buffer_flush_interval": f"{opts.access_log_flush_s}s",
                "buffer_size_bytes": 16384,
            },
        },
    }


def build_bootstrap(opts: BootstrapOptions) -> dict[str, Any]:
    """The bootstrap as a plain mapping, ready to dump as YAML. Raises ValueError for
    combinations that cannot work."""
    if opts.fail_open and opts.lb == "original-dst":
        # With the picker skipped there is no destination header, and ORIGINAL_DST would then
        # use the connection's own destination: Envoy's listener, a loop.
        raise ValueError("fail-open needs --lb override-host (ORIGINAL_DST has no fallback)")
    hcm: dict[str, Any] = {
        "@type": f"{_T}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference",
        "codec_type": "AUTO",
        "stream_idle_timeout": "600s",
        "route_config": {
            "name": "inference",
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [_route(opts)]}],
        },
        "http_filters": [
            _strip_picker_headers_filter(opts),
            _ext_proc_filter(opts),
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": f"{_T}.filters.http.router.v3.Router"},
            },
        ],
    }
    if opts.access_log:
        hcm["access_log"] = [_access_log(opts)]
    host, _ = _split_host_port(opts.extproc)
    extproc_cluster = {
        "name": "extproc",
        "type": "STRICT_DNS",
        "connect_timeout": "2s",
        "lb_policy": "ROUND_ROBIN",
        # Active gRPC health checks on the picker's readiness: a dead or draining replica is
        # skipped, and when none is healthy the ext_proc stream fails at once, before any body
        # chunk is streamed, so fail-open really continues (a stream that dies mid-body cannot:
        # Envoy keeps no copy of what it streamed). Panic routing would defeat that.
        "health_checks": [
            {
                "timeout": "1s",
                "interval": f"{opts.health_interval_s}s",
                "no_traffic_interval": f"{opts.health_interval_s}s",
                # Two misses, not one: a live picker starved of CPU for a moment must not be
                # marked down (fail closed turns that into 500s). A dead one refuses at once.
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "grpc_health_check": {"service_name": "readiness"},
            }
        ],
        "common_lb_config": {
            "healthy_panic_threshold": {"value": 0},
            # Envoy holds a health change that comes within 1 s (the default window) of the
            # previous one, and delivers it to the worker threads only when that second ends.
            # A picker seen healthy again soon after it was seen down would then get no
            # streams for up to a second while the admin stats already count it healthy: in
            # fail-closed mode that is a second of 500s for nothing. A handful of picker hosts
            # gains nothing from merging, so every change reaches the workers at once.
            "update_merge_window": "0s",
        },
        # One picker stream per request in flight: the same ceiling as the model servers.
        "circuit_breakers": {"thresholds": [_thresholds(opts, retries=3)]},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": f"{_T}.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {
                    "http2_protocol_options": {
                        "max_concurrent_streams": opts.extproc_streams_per_connection
                    }
                },
            }
        },
        "load_assignment": {
            "cluster_name": "extproc",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": _socket(a)}} for a in _picker_addresses(opts)
                    ]
                }
            ],
        },
    }
    _picker_failover(hcm["http_filters"][1], extproc_cluster)
    hcm["local_reply_config"] = _picker_unavailable_reply()
    if opts.extproc_tls:
        # Health checks use the same socket: the picker serves `readiness` on its TLS port too.
        extproc_cluster["transport_socket"] = _picker_tls(opts, host)
    doc: dict[str, Any] = {
        "static_resources": {
            "listeners": [
                {
                    "name": "inference",
                    "address": _socket(f"{opts.listen_address}:{opts.listen_port}"),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": hcm,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [_model_cluster(opts), extproc_cluster],
        }
    }
    if opts.admin_port is not None:
        doc["admin"] = {"address": _socket(f"127.0.0.1:{opts.admin_port}")}
    return doc


def _picker_addresses(opts: BootstrapOptions) -> list[str]:
    """The picker cluster's hosts: every worker port of the picker, then the replicas."""
    if opts.extproc_workers < 1:
        raise ValueError("extproc_workers must be >= 1")
    host, port = _split_host_port(opts.extproc)
    if ":" in host:
        host = f"[{host}]"
    workers = [f"{host}:{port + i}" for i in range(opts.extproc_workers)]
    return [*workers, *opts.extproc_replicas]


def _picker_failover(ext_proc: dict[str, Any], cluster: dict[str, Any]) -> None:
    """A crashed picker replica costs no request while another is up. Health checks need two
    misses (seconds); until then round robin keeps opening streams to the dead one. So the
    stream is retried on another replica when it cannot be opened (connection refused or
    reset before the picker answered), and a replica that refuses a connection is ejected at
    once by outlier detection, without waiting for the health check."""
    ext_proc["typed_config"]["grpc_service"]["retry_policy"] = {
        "retry_on": "connect-failure,refused-stream,reset,unavailable",
        "num_retries": 2,
        "retry_back_off": {"base_interval": "0.01s", "max_interval": "0.1s"},
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": f"{_T}.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                },
            }
        ],
        "host_selection_retry_max_attempts": 3,
    }
    # Envoy allows 3 concurrent retries per cluster by default: a replica dying under load
    # needs one retry per stream that was about to open on it.
    for t in cluster.setdefault("circuit_breakers", {}).setdefault("thresholds", [{}]):
        t["max_retries"] = max(t.get("max_retries", 3), 1024)
    cluster["outlier_detection"] = {
        # Local-origin failures (connect refused/timeout, reset) are counted apart from gRPC
        # status codes, so a picker's own 4xx/5xx answers never eject it.
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": 1,
        "consecutive_gateway_failure": 2,
        "interval": "1s",
        "base_ejection_time": "5s",
        # Ejection time grows with each ejection; a restarted replica is back as soon as
        # an active health check passes (successful_active_health_check_uneject_host).
        "max_ejection_time": "10s",
        "max_ejection_percent": 50,
    }


PICKER_UNAVAILABLE_BODY = (
    '{"error": {"message": "the endpoint picker is unavailable", "type": "server_error", '
    '"code": "picker_unavailable"}}'
)


def _picker_unavailable_reply() -> dict[str, Any]:
    """Envoy's own 500s become a 503 with a JSON body like the picker's errors, the reason
    header and `retry-after`: a refusal the client can tell apart and retry, not a bare 500
    (issue 15: a picker starved of CPU for ~3 s is health-checked down, and every request
    until it is seen up again failed here). The only local 500 in this config is the ext_proc
    filter failing closed (no picker reachable, or the stream broke); the picker's own 500
    says the same thing in other words, and is the only other local reply the mapper
    touches (its 4xx/503/429 answers keep their status, body and headers)."""
    return {
        "mappers": [
            {
                "status_code": 503,
                "headers_to_add": [
                    {
                        "header": {
                            "key": protocol.DROPPED_REASON_HEADER,
                            "value": "picker-unavailable",
                        },
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    },
                    {
                        "header": {"key": "retry-after", "value": "1"},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    },
                ],
                "filter": {
                    "status_code_filter": {
                        "comparison": {
                            "op": "EQ",
                            "value": {"default_value": 500, "runtime_key": "extproc.lr_500"},
                        }
                    }
                },
                "body": {"inline_string": PICKER_UNAVAILABLE_BODY},
                "body_format_override": {
                    "text_format": "%LOCAL_REPLY_BODY%",
                    "content_type": "application/json",
                },
            }
        ]
    }


def render_bootstrap(opts: BootstrapOptions) -> str:
    return yaml.safe_dump(build_bootstrap(opts), sort_keys=False)
