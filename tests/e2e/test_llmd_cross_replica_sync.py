"""llm-d's `dataLayer.crossReplicaSyncInterval` behind a real Envoy: `extproc serve` on a bare
EndpointPickerConfig that sets it to 1s, with a Redis index, exchanges its in-flight counts
once a second, not every `state.shared_inflight.interval_s` default of 50 ms (before, the
interval was noted as ignored and the exchange ran ~20 times a second)."""

from __future__ import annotations

import re
import time

import httpx

from extproc.stack import Stack, StackOptions
from tests.redis_servers import RedisServer, needs_redis

CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
dataLayer:
  crossReplicaSyncInterval: 1s
plugins:
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""
WATCH_S = 2.0


def exchanges(stack: Stack) -> float:
    url = f"http://127.0.0.1:{stack.picker_admin_port}/metrics"
    text = httpx.get(url, timeout=10).text
    found = re.search(r"^extproc_shared_inflight_exchanges_total (\S+)$", text, re.M)
    assert found, "no in-flight exchange counter: sharing is off"
    return float(found.group(1))


@needs_redis
def test_cross_replica_sync_interval_paces_the_in_flight_exchange(
    tmp_path, redis_server: RedisServer
):
    path = tmp_path / "picker.yaml"
    path.write_text(CONFIG)
    opts = StackOptions(
        upstreams=1, redis_url=redis_server.url, extproc_args=("--config", str(path))
    )
    with Stack(opts) as stack, httpx.Client(base_url=stack.url, timeout=30) as http:
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        assert http.post("/v1/chat/completions", json=body).status_code == 200
        before = exchanges(stack)
        time.sleep(WATCH_S)
        # 1 s apart: 2 in the window, 3 at most with a retry; at 50 ms there would be ~40.
        delta = exchanges(stack) - before
        assert 1 <= delta <= WATCH_S + 1
