"""Real llm-d EndpointPickerConfig files, unchanged, served by `extproc serve --config`
behind a real Envoy (tests/fixtures/llmd-configs, copied from llm-d's repositories)."""

from __future__ import annotations

from pathlib import Path

import httpx
import yaml

from extproc.stack import Stack, StackOptions

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "llmd-configs"
PREFILLER = "x-prefiller-host-port"


def chat(text: str) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}]}


LONG = " ".join(f"word{i}" for i in range(400))  # ~hundreds of tokens: well past 16


def test_llm_d_deploy_config_routes_and_keeps_a_conversation_where_its_cache_is():
    config = CORPUS / "router--deploy_config_epp-config.yaml"
    opts = StackOptions(upstreams=3, extproc_args=("--config", str(config)))
    with Stack(opts) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        first = http.post("/v1/chat/completions", json=chat("conv A " + LONG)).json()
        assert first["destination_header"] == first["endpoint"]
        assert first["endpoint"] in s.upstream_addresses
        for _ in range(5):  # the prefix scorer holds the conversation on its endpoint
            again = http.post("/v1/chat/completions", json=chat("conv A " + LONG)).json()
            assert again["endpoint"] == first["endpoint"]


def test_llm_d_pd_config_sends_long_uncached_prompts_through_a_prefiller():
    """sim-pd-epp-config: prefix-based-pd-decider with nonCachedTokens 16 and llm-d roles."""
    config = CORPUS / "router--deploy_config_sim-pd-epp-config.yaml"
    roles = [{"llm-d.ai/role": "decode"}, {"llm-d.ai/role": "prefill"}]
    opts = StackOptions(upstreams=2, endpoint_labels=roles, extproc_args=("--config", str(config)))
    with Stack(opts) as s:
        decode, prefill = s.upstream_addresses
        with httpx.Client(base_url=s.url, timeout=30) as http:
            long = http.post("/v1/chat/completions", json=chat(LONG)).json()
            assert long["endpoint"] == decode
            assert long["picker_headers"] == {PREFILLER: prefill}
            # The same prompt again: the decode endpoint now holds it, no prefill stage.
            again = http.post("/v1/chat/completions", json=chat(LONG)).json()
            assert again["endpoint"] == decode
            assert again["picker_headers"] == {}
            short = http.post("/v1/chat/completions", json=chat("hi")).json()
            assert short["endpoint"] == decode and short["picker_headers"] == {}


def test_precise_config_without_a_local_tokenizer_serves_and_says_it_is_degraded():
    """llm-d's precise-prefix config names `hf-repo/model-name`, which is nowhere on disk:
    the picker still routes (approximate keys) and says so in its log and its metrics."""
    config = CORPUS / "router--deploy_config_epp-precise-prefix-cache-config.yaml"
    with Stack(StackOptions(upstreams=2, extproc_args=("--config", str(config)))) as s:
        with httpx.Client(base_url=s.url, timeout=30) as http:
            r = http.post("/v1/chat/completions", json=chat("hello"))
            assert r.status_code == 200 and r.json()["endpoint"] in s.upstream_addresses
        metrics = httpx.get(f"http://127.0.0.1:{s.picker_admin_port}/metrics", timeout=5).text
        assert "extproc_llmd_degraded 1.0" in metrics
        assert "no local tokenizer for model 'hf-repo/model-name'" in s.logs("extproc")


def test_serve_refuses_a_config_with_pending_plugins_naming_the_issue(capsys, tmp_path):
    from extproc.cli import main

    # GIE v1.x's SLO-aware profile handler is pending (issue 16).
    config = tmp_path / "pending.yaml"
    doc = yaml.safe_load(
        (CORPUS / "router--deploy_config_soft-reflective-ceiling-epp-config.yaml").read_text()
    )
    doc["plugins"].append({"type": "slo-aware-profile-handler"})
    config.write_text(yaml.safe_dump(doc))
    args = ["serve", "--config", str(config), "--endpoints", "127.0.0.1:1"]
    assert main(args) == 2
    assert "'slo-aware-profile-handler' is pending: built in issue 16" in capsys.readouterr().err


def test_the_soft_ceiling_and_program_aware_configs_serve_unchanged():
    """The last two real configs that were refused: served as they are, flow control on.
    Their detector is the default utilization detector, which reads scraped vLLM figures:
    simulated vLLM servers provide them."""
    for name in (
        "router--deploy_config_soft-reflective-ceiling-epp-config.yaml",
        "router--deploy_config_sim-program-aware-config.yaml",
    ):
        opts = StackOptions(
            upstreams=2,
            sim_args=("--fast", "50", "--chat-max-tokens", "4"),
            extproc_args=("--config", str(CORPUS / name)),
        )
        with Stack(opts) as s, httpx.Client(base_url=s.url, timeout=30) as http:
            assert s.fleet is not None
            for program in ("agent-a", "agent-b"):
                body = {**chat("hello " + program), "model": s.fleet.model, "max_tokens": 4}
                r = http.post(
                    "/v1/chat/completions",
                    json=body,
                    headers={"x-llm-d-inference-fairness-id": program},
                )
                assert r.status_code == 200, (name, r.text)
                assert r.headers["x-served-by"] in s.upstream_addresses
            text = httpx.get(f"http://127.0.0.1:{s.picker_admin_port}/metrics", timeout=5).text
            flow = [ln for ln in text.splitlines() if ln.startswith("extproc_flow_requests_total{")]
            dispatched = [float(ln.split()[-1]) for ln in flow if 'outcome="dispatched"' in ln]
            assert sum(dispatched) == 2, (name, text)


async def test_program_aware_fairness_lets_a_light_program_overtake_a_heavy_one(tmp_path):
    """sim-program-aware-config's policy, given one slot (a concurrency detector) in front
    of one slow upstream: a heavy program holds the slot and queues two more long prompts;
    a light program's request, queued last, is served first when the slot frees (least
    attained service), where first-come-first-served would serve it last."""
    import asyncio
    import time

    from extproc.sim.echo import HEADERS_DELAY_HEADER

    doc = yaml.safe_load(
        (CORPUS / "router--deploy_config_sim-program-aware-config.yaml").read_text()
    )
    doc["plugins"].append({"type": "concurrency-detector", "parameters": {"maxConcurrency": 1}})
    doc["flowControl"]["saturationDetector"] = {"pluginRef": "concurrency-detector"}
    config = tmp_path / "picker.yaml"
    config.write_text(yaml.safe_dump(doc))
    done: dict[str, float] = {}

    async def post(c: httpx.AsyncClient, tag: str, program: str, text: str, delay_ms: int):
        headers = {"x-llm-d-inference-fairness-id": program, HEADERS_DELAY_HEADER: str(delay_ms)}
        r = await c.post("/v1/chat/completions", json=chat(text), headers=headers)
        assert r.status_code == 200, r.text
        done[tag] = time.monotonic()

    opts = StackOptions(upstreams=1, extproc_args=("--config", str(config)))
    with Stack(opts) as s:
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
            holder = asyncio.create_task(post(c, "holder", "heavy", LONG, 1500))
            await asyncio.sleep(0.5)
            heavy = [
                asyncio.create_task(post(c, f"heavy{i}", "heavy", f"{i} {LONG}", 300))
                for i in range(2)
            ]
            await asyncio.sleep(0.3)
            light = asyncio.create_task(post(c, "light", "light", "hi", 300))
            await asyncio.gather(holder, *heavy, light)
    assert done["light"] < min(done["heavy0"], done["heavy1"]), done


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "_total "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exported")


def test_precise_config_with_a_local_tokenizer_routes_on_kv_events(tmp_path):
    """llm-d's sim-epp-kvcache-config, unchanged as the scheduling section, names TinyLlama:
    with that tokenizer in a local folder, precise keys and the sims' KV events drive
    routing. (Wrapped only to point the tokenizer lookup at a folder and to bind an
    ephemeral KV-event port instead of the file's fixed 5557.)"""
    import time

    import yaml

    from extproc.stack import SIM_TOKENIZER_DIR, SimFleet

    model = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    (tmp_path / "tok" / "TinyLlama").mkdir(parents=True)
    (tmp_path / "tok" / model).symlink_to(SIM_TOKENIZER_DIR)
    corpus = yaml.safe_load(
        (CORPUS / "router--deploy_config_sim-epp-kvcache-config.yaml").read_text()
    )
    sim_args = ("--model", model, "--fast", "20", "--chat-max-tokens", "4")
    with SimFleet(2, sim_args, log_dir=tmp_path) as fleet:
        wrapper = {
            "tokenizer_dirs": [str(tmp_path / "tok")],
            "index": {"kv_events": {"bind": f"tcp://127.0.0.1:{fleet.kv_events_port}"}},
            "scheduling": corpus,
        }
        config = tmp_path / "picker.yaml"
        config.write_text(yaml.safe_dump(wrapper, sort_keys=False))
        opts = StackOptions(fleet=fleet, extproc_args=("--config", str(config)))
        with Stack(opts) as s, httpx.Client(base_url=s.url, timeout=60) as http:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": LONG}],
                "max_tokens": 4,
            }
            first = http.post("/v1/chat/completions", json=body)
            assert first.status_code == 200
            served = first.headers["x-served-by"]
            admin = f"http://127.0.0.1:{s.picker_admin_port}/metrics"
            deadline = time.monotonic() + 20
            while metric(httpx.get(admin, timeout=5).text, "extproc_kv_events_blocks_stored") == 0:
                assert time.monotonic() < deadline, "no KV events reached the picker"
                time.sleep(0.2)
            for _ in range(3):
                again = http.post("/v1/chat/completions", json=body)
                assert again.headers["x-served-by"] == served
            text = httpx.get(admin, timeout=5).text
            assert metric(text, "extproc_prefix_blocks_matched") > 0
            assert metric(text, "extproc_llmd_degraded") == 0


def test_gpu_config_keeps_requests_off_a_busy_gpu_reported_by_dcgm(tmp_path):
    """llm-d's sim-epp-gpu-config: DCGM says which pod's GPU is over 90% busy; the
    endpoint-attribute filter keeps requests off it, and follows when it changes. (Wrapped
    only to poll a fake exporter on an ephemeral port instead of the file's 9400.)"""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import yaml

    util = {"pod-a": 95, "pod-b": 20}

    class Exporter(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = "".join(
                f'DCGM_FI_DEV_GPU_UTIL{{gpu="0",pod="{pod}"}} {v}\n' for pod, v in util.items()
            ).encode()
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Exporter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    corpus = yaml.safe_load((CORPUS / "router--deploy_config_sim-epp-gpu-config.yaml").read_text())
    wrapper = {
        "state": {"dcgm": {"port": server.server_address[1], "interval_s": 0.1}},
        "scheduling": corpus,
    }
    config = tmp_path / "picker.yaml"
    config.write_text(yaml.safe_dump(wrapper, sort_keys=False))
    opts = StackOptions(
        upstreams=2,
        endpoint_labels=[{}, {}],
        endpoint_names=["pod-a", "pod-b"],
        extproc_args=("--config", str(config)),
    )
    try:
        with Stack(opts) as s, httpx.Client(base_url=s.url, timeout=30) as http:
            a, b = s.upstream_addresses

            def served() -> set[str]:
                return {
                    http.post("/v1/chat/completions", json=chat(f"q{i}")).json()["endpoint"]
                    for i in range(8)
                }

            deadline = time.monotonic() + 20
            while served() != {b}:
                assert time.monotonic() < deadline, "pod-a's busy GPU never kept requests off it"
                time.sleep(0.3)
            util.update({"pod-a": 10, "pod-b": 99})
            deadline = time.monotonic() + 20
            while served() != {a}:
                assert time.monotonic() < deadline, "the filter did not follow DCGM"
                time.sleep(0.3)
    finally:
        server.shutdown()
        server.server_close()
