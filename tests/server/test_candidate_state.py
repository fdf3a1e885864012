"""The candidates a decision schedules carry each endpoint's learned prefill speed, built
without `dataclasses.replace` on the hot path (issue 17) and equal to what it would give."""

from __future__ import annotations

import dataclasses

import orjson

from extproc.core import EndpointState
from extproc.server.app import App
from extproc.testing import post


def test_the_fast_copy_equals_replace_for_every_field():
    values = {}
    for i, f in enumerate(dataclasses.fields(EndpointState)):
        if f.name in ("running_adapters", "waiting_adapters"):
            values[f.name] = frozenset({f"a{i}"})
        elif f.name == "attributes":
            values[f.name] = {"GPUUtilization": 0.5}
        elif f.name == "is_stale":
            values[f.name] = False
        else:
            values[f.name] = i + 1
    state = EndpointState(**values)
    assert state.with_prefill_tps(1234.5) == dataclasses.replace(state, prefill_tps=1234.5)
    assert state.with_prefill_tps(None).prefill_tps is None


async def test_candidates_carry_the_learned_prefill_speed(app: App, monkeypatch):
    router = app.router
    assert router.speeds is not None
    seen = []
    schedule = router.scheduler.schedule

    def spy(req, cands, **kw):
        seen.extend(cands)
        return schedule(req, cands, **kw)

    monkeypatch.setattr(router.scheduler, "schedule", spy)
    address = router.pool.snapshot()[0].address
    router.speeds.observe(address, 8000, 1.0)
    chat = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "speed"}]})
    await router.route("/v1/chat/completions", post("/v1/chat/completions"), chat)
    by_address = {c.endpoint.address: c.state.prefill_tps for c in seen}
    assert by_address[address] == 8000
    # Others get the fleet's median, as before.
    assert all(v == 8000 for v in by_address.values())
