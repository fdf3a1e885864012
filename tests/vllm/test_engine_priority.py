"""Engine-side priority against a real vLLM (`--scheduling-policy priority`).

The body form, on the session fleet: `extproc serve` behind Envoy with
`flow_control.engine_priority` writes each request's band into the body as `priority`, and
the engine accepts what arrives. The proof that the engine parsed the picker's value and
not the client's: a client `priority` that is not an integer, which vLLM refuses (400,
`int_parsing`, checked directly against a server), is answered 200 through the picker
because it was replaced; a non-integer `x-vllm-priority` header (which vLLM reads before the
body) is removed.

The header form, on an engine of its own with one slot (`--max-num-seqs 1`): while a long
request holds the slot, a batch request and then an interactive one wait in the engine's
queue, each with a client body `priority` that would order them the other way. The
interactive one is served first: the engine ordered them by the `x-vllm-priority` the
picker set, over the body's. A non-integer body `priority` is still the engine's to refuse
(the header form leaves the body alone)."""

from __future__ import annotations

import re
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extproc.stack import Stack, StackOptions, free_port
from tests.e2e.flow_configs import in_flight_scheduling
from tests.vllm.conftest import picker_config
from tests.vllm.fleet import MODEL_NAME, VllmFleet

OBJECTIVES = "interactive: 10\nbatch: -1\n"


@pytest.fixture(scope="module")
def priority_stack(vllm_fleet: VllmFleet, tmp_path_factory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("engine-priority")
    (tmp / "objectives.yaml").write_text(OBJECTIVES)
    scheduling = in_flight_scheduling()
    flow = {"objectives_file": str(tmp / "objectives.yaml"), "engine_priority": True}
    cfg = picker_config(vllm_fleet, tmp / "picker.yaml", scheduling=scheduling, flow_control=flow)
    opts = StackOptions(fleet=vllm_fleet, extproc_args=("--config", str(cfg)))  # type: ignore[arg-type]
    with Stack(opts) as stack:
        yield stack


def test_a_real_engine_takes_the_band_not_the_clients_priority(
    vllm_fleet: VllmFleet, priority_stack: Stack
):
    chat = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hello engine priority"}],
        "max_tokens": 3,
        "priority": "first please",
    }
    direct = httpx.post(f"{vllm_fleet.servers[0].url}/v1/chat/completions", json=chat, timeout=60)
    assert direct.status_code == 400, direct.text  # the engine refuses the client's value
    url = f"{priority_stack.url}/v1/chat/completions"
    for objective in ("interactive", "batch", None):
        headers = {"x-vllm-priority": "not a number"}
        if objective:
            headers["x-llm-d-inference-objective"] = objective
        r = httpx.post(url, json=chat, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    # Completions without a client priority: the band's is inserted.
    body = {"model": MODEL_NAME, "prompt": "inserted priority", "max_tokens": 2}
    r = httpx.post(f"{priority_stack.url}/v1/completions", json=body,
                   headers={"x-llm-d-inference-objective": "interactive"}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def one_slot_stack(tmp_path_factory) -> Iterator[tuple[Stack, str]]:
    """One vLLM server that runs one request at a time, behind a picker with the header form."""
    logs = Path(tempfile.mkdtemp(prefix="extproc-vllm-one-slot-"))
    fleet = VllmFleet.start(
        1,
        ports=[free_port()],
        kv_events_port=free_port(),
        extra_args=(
            "--max-num-seqs",
            "1",
            # Room for a holder long enough to outlast the others' arrival on a loaded machine.
            "--max-model-len",
            "2048",
            "--num-gpu-blocks-override",
            "80",
            "--scheduling-policy",
            "priority",
        ),
        log_dir=logs,
    )
    try:
        tmp: Path = tmp_path_factory.mktemp("engine-priority-header")
        (tmp / "objectives.yaml").write_text(OBJECTIVES)
        flow = {"objectives_file": str(tmp / "objectives.yaml"), "engine_priority": "header"}
        cfg = picker_config(
            fleet, tmp / "picker.yaml", scheduling=in_flight_scheduling(), flow_control=flow
        )
        opts = StackOptions(fleet=fleet, extproc_args=("--config", str(cfg)))  # type: ignore[arg-type]
        with Stack(opts) as stack:
            yield stack, fleet.servers[0].url
    finally:
        fleet.close()


def waiting(server_url: str) -> float:
    text = httpx.get(f"{server_url}/metrics", timeout=10).text
    return sum(
        float(v) for v in re.findall(r"^vllm:num_requests_waiting\{[^}]*\} (\S+)$", text, re.M)
    )


def test_a_one_slot_engine_orders_its_queue_by_the_pickers_header(
    one_slot_stack: tuple[Stack, str],
):
    """The engine's order, read from the engine itself: the two queued requests share a
    long prompt prefix no request had before, so the first to run computes it (0 cached
    tokens) and the second is served it from the prefix cache. (Completion times are no
    witness: on a loaded machine the API server hands out responses in bursts.)"""
    stack, server = one_slot_stack
    url = f"{stack.url}/v1/completions"

    def attempt() -> dict[str, dict] | None:
        """One round; None when the holder ended before both others were queued (a loaded
        machine can delay a request in the API server for seconds)."""
        usage: dict[str, dict] = {}
        errors: list[BaseException] = []
        nonce = uuid.uuid4().hex
        shared = nonce + " " + " ".join(f"shared{i}" for i in range(30))

        def post(name: str, prompt: str, objective: str | None, tokens: int, priority: int):
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": tokens,
                    "ignore_eos": True, "priority": priority}  # fmt: skip
            headers = {"x-llm-d-inference-objective": objective} if objective else {}
            try:
                r = httpx.post(url, json=body, headers=headers, timeout=120)
                assert r.status_code == 200, r.text
                usage[name] = r.json()["usage"]
            except BaseException as exc:  # reported by the test thread
                errors.append(exc)

        # The slot's holder, long enough for the other two to reach the engine's queue.
        holder = threading.Thread(target=post, args=("holder", f"hold {nonce}", None, 1800, 0))
        holder.start()
        time.sleep(0.1)
        # Batch (band -1: header 1) first, with a body priority that would put it first;
        # interactive (band 10: header -10) later, with one that would put it last.
        threads = [
            holder,
            threading.Thread(target=post, args=("batch", shared + " b", "batch", 8, -100)),
            threading.Thread(
                target=post, args=("interactive", shared + " i", "interactive", 8, 100)
            ),
        ]
        threads[1].start()
        time.sleep(0.05)
        threads[2].start()
        deadline = time.monotonic() + 60
        while (w := waiting(server)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        queued = w >= 2 and holder.is_alive()
        for t in threads:
            t.join(timeout=180)
        assert not errors, errors
        return usage if queued else None

    for _ in range(3):
        if (usage := attempt()) is not None:
            break
    else:
        # Inconclusive, not wrong: the engine never had both waiting at once, so it had no
        # order to choose. Seen on this 2-core machine under load (tenth session: conclusive
        # and passing at 21:48, inconclusive in three later invocations; why the two did
        # not reach the engine's queue while the holder ran was not found).
        pytest.skip("in 3 rounds the engine never had both requests queued behind the holder")
    cached = {
        k: (v.get("prompt_tokens_details") or {}).get("cached_tokens") for k, v in usage.items()
    }
    assert cached["interactive"] == 0, usage  # ran first: computed the shared prefix
    assert cached["batch"] >= 32, usage  # ran second: the prefix was cached

    # The body is the engine's to validate: a non-integer `priority` is refused as sent.
    r = httpx.post(url, json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 1,
                              "priority": "first please"}, timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
