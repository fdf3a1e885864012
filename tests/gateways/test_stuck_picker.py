"""A picker whose event loop gets stuck, under Istio's ext_proc settings. In
FULL_DUPLEX_STREAMED Envoy arms no message_timeout and applies no gRPC deadline (docs/
gateways.md "A slow or frozen picker"), so a request the stuck picker holds would hang until
the connection manager's stream idle timeout (600 s in this bootstrap). The picker's loop
watchdog (server/watchdog.py) logs and counts a stall, and ends the process when the loop
stays stuck: the held request then fails at once with the picker-unavailable 503.

The loop is stuck by a third-party scorer that sleeps (a plugin doing blocking I/O), found
through an `extproc.plugins` entry point in a directory put on PYTHONPATH."""

from __future__ import annotations

import textwrap
import time
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from extproc.bootstrap import PICKER_UNAVAILABLE_BODY
from extproc.server.watchdog import STUCK_EXIT_CODE
from extproc.stack import Stack, StackOptions, wait_until
from tests.gateways.test_drain import istio

pytestmark = pytest.mark.e2e

PLUGIN = textwrap.dedent(
    """\
    import time

    from extproc.plugins import PluginParams


    class SleepOnModel:
        \"\"\"Blocks the event loop for the seconds the model name says (`sleep-1.5`).\"\"\"

        type_name = "sleep-on-model"

        class Params(PluginParams):
            pass

        def __init__(self, params):
            pass

        def score(self, req, cands):
            if req.model.startswith("sleep-"):
                time.sleep(float(req.model.removeprefix("sleep-")))
            return [0.0 for _ in cands]
    """
)


def plugin_dir(root: Path) -> Path:
    site = root / "site"
    dist = site / "sleep_plugin-0.1.dist-info"
    dist.mkdir(parents=True)
    (site / "sleep_plugin.py").write_text(PLUGIN)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sleep-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[extproc.plugins]\nsleep-on-model = sleep_plugin:SleepOnModel\n"
    )
    return site


def chat(model: str) -> bytes:
    return orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})


def test_a_stuck_loop_is_logged_counted_and_ends_the_process(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(plugin_dir(tmp_path)))
    cfg = tmp_path / "picker.yaml"
    scheduling = {
        "plugins": [{"type": "sleep-on-model"}],
        "schedulingProfiles": [{"name": "default", "plugins": [{"pluginRef": "sleep-on-model"}]}],
    }
    server = {"loop_stall_s": 0.3, "loop_stall_exit_s": 2.5}
    cfg.write_text(yaml.safe_dump({"server": server, "scheduling": scheduling}))
    opts = StackOptions(
        upstreams=2, lb="override-host", bootstrap=istio, extproc_args=("--config", str(cfg))
    )
    with Stack(opts) as s, httpx.Client(base_url=s.url, timeout=8) as c:
        # A stall shorter than the exit bound: the request is served late, the stall is
        # logged with the stack it was stuck in, and counted.
        r = c.post("/v1/chat/completions", content=chat("sleep-1"))
        assert r.status_code == 200, r.text
        metrics = httpx.get(f"http://127.0.0.1:{s.picker_admin_port}/metrics").text
        assert "extproc_loop_stalls_total 1.0" in metrics
        # The watchdog sees the end at its next tick, a moment after the answer left.
        wait_until(
            lambda: "serving loop turned again" in s.logs("extproc"),
            timeout_s=2,
            what="stall end logged",
        )
        log = s.logs("extproc")
        assert "serving loop stalled" in log and "sleep_plugin.py" in log
        # Stuck for good: the process ends at the exit bound and Envoy fails the held
        # request with the picker-unavailable reply, instead of holding it.
        t0 = time.monotonic()
        r = c.post("/v1/chat/completions", content=chat("sleep-60"))
        took = time.monotonic() - t0
        assert r.status_code == 503, (r.status_code, r.text)
        assert r.json() == orjson.loads(PICKER_UNAVAILABLE_BODY)
        assert took < 5, took
        assert s._procs["extproc"].wait(timeout=5) == STUCK_EXIT_CODE
        log = s.logs("extproc")
        assert "serving loop stuck for" in log and f"exiting with code {STUCK_EXIT_CODE}" in log
