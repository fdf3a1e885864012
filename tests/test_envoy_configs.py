"""The bootstraps in envoy/ are what `extproc envoy-config` emits, and real Envoy accepts them."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path

import pytest

from extproc.cli import build_parser, main
from extproc.stack import envoy_binary

ROOT = Path(__file__).resolve().parents[1]
ENDPOINTS = "10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000"
COMMANDS = {
    "original-dst.yaml": "",
    "override-host.yaml": f"--lb override-host --endpoints {ENDPOINTS}",
    "override-host-fail-open.yaml": f"--lb override-host --endpoints {ENDPOINTS} --fail-open",
}


def emitted(args: str, capsys) -> str:
    ns = build_parser().parse_args(["envoy-config", *shlex.split(args)])
    assert ns.func(ns) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_committed_bootstrap_matches_generator(name: str, capsys):
    assert (ROOT / "envoy" / name).read_text() == emitted(COMMANDS[name], capsys)


def test_every_yaml_in_envoy_dir_is_covered():
    assert sorted(p.name for p in (ROOT / "envoy").glob("*.yaml")) == sorted(COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_real_envoy_validates_bootstrap(name: str):
    result = subprocess.run(
        [
            envoy_binary(),
            "--mode",
            "validate",
            "-c",
            str(ROOT / "envoy" / name),
            "--disable-hot-restart",
            "--log-level",
            "error",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_override_host_without_endpoints_is_a_config_error(capsys):
    assert main(["envoy-config", "--lb", "override-host"]) == 2
    assert "--endpoints" in capsys.readouterr().err


def test_fail_open_with_original_dst_is_refused(capsys):
    """Without a picker header ORIGINAL_DST would send the request back to Envoy itself."""
    assert main(["envoy-config", "--fail-open"]) == 2
    assert "override-host" in capsys.readouterr().err


def test_access_log_flush_interval_is_a_flag(capsys):
    """`--access-log-flush-s`: how late the picker may hear of a request's end (queued work
    waits that long for the room it freed); 20 ms unless told."""
    assert "buffer_flush_interval: 0.02s" in emitted("", capsys)
    assert "buffer_flush_interval: 0.1s" in emitted("--access-log-flush-s 0.1", capsys)


@pytest.mark.parametrize("lb", ["", f"--lb override-host --endpoints {ENDPOINTS}"])
def test_retries_apply_in_both_lb_modes(lb: str, capsys):
    """`--retries` (its help says so): the route's retry policy, whichever --lb; 0 leaves
    the policy out, and with it the per-try idle timeout."""
    import yaml

    def route(args: str) -> dict:
        cfg = yaml.safe_load(emitted(f"{lb} {args}", capsys))
        (listener,) = cfg["static_resources"]["listeners"]
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        return hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]

    assert route("")["retry_policy"]["num_retries"] == 2
    assert route("--retries 5")["retry_policy"]["num_retries"] == 5
    assert "retry_policy" not in route("--retries 0")


def test_response_trailers_send_keeps_the_stream_to_the_responses_end(capsys):
    """`--response-trailers send` (flow control's eviction of a response under way): the
    trailer mode, and the response-header phase it needs (auto keeps it, skip is refused)."""
    assert "response_trailer_mode: SKIP" in emitted("", capsys)
    out = emitted("--response-trailers send --response-headers auto", capsys)
    assert "response_trailer_mode: SEND" in out
    assert "response_header_mode: SEND" in out
    assert main(["envoy-config", "--response-trailers", "send", "--response-headers", "skip"]) == 2
    assert "response-header phase" in capsys.readouterr().err
