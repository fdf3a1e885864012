"""Bootstrap options of the exchange with the picker: one cluster host per worker port, the
streams-per-connection cap, and the request body mode."""

from __future__ import annotations

import pytest

from extproc.bootstrap import BootstrapOptions, build_bootstrap
from extproc.cli import build_parser


def picker_cluster(doc: dict) -> dict:
    return next(c for c in doc["static_resources"]["clusters"] if c["name"] == "extproc")


def hosts(doc: dict) -> list[tuple[str, int]]:
    eps = picker_cluster(doc)["load_assignment"]["endpoints"][0]["lb_endpoints"]
    return [
        (e["endpoint"]["address"]["socket_address"]["address"],
         e["endpoint"]["address"]["socket_address"]["port_value"])
        for e in eps
    ]  # fmt: skip


def ext_proc_mode(doc: dict) -> dict:
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (f,) = [f for f in hcm["typed_config"]["http_filters"] if f["name"].endswith("ext_proc")]
    return f["typed_config"]["processing_mode"]


def test_one_host_per_worker_port_then_the_replicas():
    doc = build_bootstrap(
        BootstrapOptions(
            extproc="10.0.0.9:9010", extproc_workers=3, extproc_replicas=("10.0.0.8:9002",)
        )
    )
    assert hosts(doc) == [
        ("10.0.0.9", 9010), ("10.0.0.9", 9011), ("10.0.0.9", 9012), ("10.0.0.8", 9002)
    ]  # fmt: skip


def test_ipv6_picker_worker_ports():
    doc = build_bootstrap(BootstrapOptions(extproc="[fd00::1]:9010", extproc_workers=2))
    assert hosts(doc) == [("fd00::1", 9010), ("fd00::1", 9011)]


def test_zero_workers_is_refused():
    with pytest.raises(ValueError, match="extproc_workers"):
        build_bootstrap(BootstrapOptions(extproc_workers=0))


def test_streams_per_connection_cap_on_the_picker_cluster():
    doc = build_bootstrap(BootstrapOptions(extproc_streams_per_connection=7))
    opts = picker_cluster(doc)["typed_extension_protocol_options"]
    h2 = next(iter(opts.values()))["explicit_http_config"]["http2_protocol_options"]
    assert h2 == {"max_concurrent_streams": 7}


def test_buffered_request_body_skips_trailers_full_duplex_sends_them():
    buffered = ext_proc_mode(build_bootstrap(BootstrapOptions(request_body_mode="BUFFERED")))
    assert buffered["request_body_mode"] == "BUFFERED"
    assert buffered["request_trailer_mode"] == "SKIP"
    duplex = ext_proc_mode(build_bootstrap(BootstrapOptions()))
    assert duplex["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert duplex["request_trailer_mode"] == "SEND"


def test_envoy_config_flag_and_serve_flag_parse():
    p = build_parser()
    assert p.parse_args(["envoy-config", "--extproc-workers", "2"]).extproc_workers == 2
    assert p.parse_args(["serve", "--worker-ports", "9010"]).worker_ports == 9010


def test_worker_i_serves_its_own_port_at_base_plus_i():
    from extproc.cli import _serve_settings

    p = build_parser()
    argv = ["serve", "--endpoints", "10.0.0.1:8000", "--worker-ports", "9010"]
    assert _serve_settings(p.parse_args(argv)).server.worker_port == 9010
    worker = p.parse_args([*argv, "--worker-index", "1"])
    assert _serve_settings(worker).server.worker_port == 9011
    assert _serve_settings(p.parse_args(argv[:3])).server.worker_port is None
