"""`auto`, the default of the spike reserve's settings (flowcontrol/spike_auto.py), behind a
real Envoy: the joint test's stack (test_flow_reserve_spike_joint.py) with only
`reserve_spike_s` set. `extproc serve` gets the joint reserve at the 0.95 quantile by
default, alone (no Redis) or sharing its flow state through Redis as replicas do, so the
reserved gauge reads the joint value and the second batch request goes to the idle server,
as there; the start line says what `auto` became and why. Before `auto` (the added term at
0.9) the gauge read the large request twice and the second batch request went beside the
first; until the thirty-second session a picker sharing flow state still got that."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from extproc.stack import Stack
from tests.e2e.flow_configs import metric_sum, reserve_stack
from tests.e2e.test_flow_reserve_spike_joint import CAP, WINDOW_S, joint_room_kept
from tests.redis_servers import RedisServer


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    with reserve_stack(
        tmp_path_factory.mktemp("flowspikeauto"), CAP, reserve_spike_s=WINDOW_S
    ) as s:
        yield s


async def test_a_picker_alone_gets_the_joint_reserve_by_default(stack: Stack):
    await joint_room_kept(stack)
    log = (stack.log_dir / "extproc.log").read_text(errors="replace")
    line = next(x for x in log.splitlines() if "flow_control auto:" in x)
    assert "reserve_spike_joint true, reserve_spike_quantile 0.95" in line, line
    assert "a spike term kept" in line, line


@pytest.fixture
def shared_stack(tmp_path, redis_server: RedisServer) -> Iterator[Stack]:
    with reserve_stack(tmp_path, CAP, redis_url=redis_server.url, reserve_spike_s=WINDOW_S) as s:
        yield s


async def test_a_picker_sharing_flow_state_gets_the_joint_reserve_too(shared_stack: Stack):
    await joint_room_kept(shared_stack)
    # The flow state really is shared: the exchange runs and is not degraded.
    assert metric_sum(shared_stack, r"^extproc_flow_shared_degraded (\S+)$") == 0
    log = (shared_stack.log_dir / "extproc.log").read_text(errors="replace")
    line = next(x for x in log.splitlines() if "flow_control auto:" in x)
    assert "reserve_spike_joint true, reserve_spike_quantile 0.95" in line, line
