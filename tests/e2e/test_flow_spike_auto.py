"""`auto`, the default of the spike reserve's settings (flowcontrol/spike_auto.py), behind a
real Envoy: the joint test's stack (test_flow_reserve_spike_joint.py) with only
`reserve_spike_s` set. `extproc serve` alone (no Redis: no shared flow state) gets the joint
reserve at the 0.95 quantile by default, so the reserved gauge reads the joint value and
the second batch request goes to the idle server, as there; the start line says what
`auto` became and why. Before `auto` (the added term at 0.9) the gauge read the large
request twice and the second batch request went beside the first."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from extproc.stack import Stack
from tests.e2e.flow_configs import reserve_stack
from tests.e2e.test_flow_reserve_spike_joint import CAP, WINDOW_S, joint_room_kept


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
    assert "no shared flow state" in line, line
