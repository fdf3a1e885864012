"""A third-party plugin package, installed (its entry point on the path), named in the config
of `extproc serve` behind a real Envoy, decides where requests go."""

from __future__ import annotations

import httpx
import pytest
import yaml

from extproc.stack import Stack, StackOptions

pytestmark = pytest.mark.e2e

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def _config(port: int) -> dict:
    return {
        "scheduling": {
            "plugins": [
                {"type": "prefer-port-scorer", "parameters": {"port": port}},
                {"type": "max-score-picker"},
            ],
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [
                        {"pluginRef": "prefer-port-scorer", "weight": 1},
                        {"pluginRef": "max-score-picker"},
                    ],
                }
            ],
        }
    }


def test_third_party_scorer_routes_through_envoy(plugin_site, tmp_path):
    with Stack(StackOptions(upstreams=3, picker=True)) as stack:
        # Upstream ports are known only once the stack is up: restart the picker on a config
        # that prefers the second upstream.
        target = stack.upstream_addresses[1]
        cfg = tmp_path / "picker.yaml"
        cfg.write_text(yaml.safe_dump(_config(int(target.rsplit(":", 1)[1]))))
        stack.stop_extproc()
        stack.options.extproc_args = ["--config", str(cfg)]
        stack.start_extproc()
        stack.wait_picker_routing(CHAT)
        with httpx.Client(base_url=stack.url, timeout=30) as http:
            served = {
                http.post("/v1/chat/completions", json=CHAT).json()["endpoint"] for _ in range(12)
            }
        assert served == {target}
