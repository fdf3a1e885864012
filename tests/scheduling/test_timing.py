"""Scheduling timing (llm-d's plugin_duration_seconds / scheduler_e2e_duration_seconds): the
instrumented scheduler decides exactly as the plain one, times every plugin call once under
its extension point, type and configured name, and reports attempts."""

from __future__ import annotations

import textwrap

import yaml

from extproc.config import build_configured_scheduler, decode_settings
from extproc.core import Endpoint
from extproc.scheduling.timing import instrument
from tests.scheduling.helpers import cand, req

DISAGG = textwrap.dedent(
    """\
    kind: EndpointPickerConfig
    plugins:
    - type: disagg-profile-handler
      parameters: {threshold: 16}
    - type: decode-filter
    - type: prefill-filter
    - {type: prefix-cache-scorer, name: prefix}
    - type: active-request-scorer
    schedulingProfiles:
    - name: decode
      plugins: [{pluginRef: decode-filter}, {pluginRef: prefix, weight: 3},
                {pluginRef: active-request-scorer}]
    - name: prefill
      plugins: [{pluginRef: prefill-filter}, {pluginRef: active-request-scorer}]
    """
)


class Sink:
    def __init__(self) -> None:
        self.plugins: dict[tuple[str, str, str], list[float]] = {}
        self.e2e: list[float] = []
        self.attempts: list[tuple[str, str | None]] = []

    def plugin_timer(self, extension_point: str, plugin_type: str, plugin_name: str):
        return self.plugins.setdefault((extension_point, plugin_type, plugin_name), []).append

    def scheduler_timer(self):
        return self.e2e.append

    def scheduled(self, model: str, endpoint: Endpoint | None) -> None:
        self.attempts.append((model, endpoint.address if endpoint else None))


def cands():
    return [
        cand("d1:8000", role="decode", prefix=4, inflight_requests=3),
        cand("d2:8000", role="decode", inflight_requests=0),
        cand("p1:8000", role="prefill", inflight_requests=1),
    ]


def test_timed_scheduler_decides_as_the_plain_one_and_times_each_plugin_once() -> None:
    plain = build_configured_scheduler(decode_settings(yaml.safe_load(DISAGG)))
    sink = Sink()
    timed = instrument(build_configured_scheduler(decode_settings(yaml.safe_load(DISAGG))), sink)
    r = req(blocks=4, tokens=2000)
    want, got = plain.schedule(r, cands()), timed.schedule(r, cands())
    assert got.endpoints == want.endpoints
    assert got.prefill == want.prefill and got.headers == want.headers
    assert got.prefill is not None  # both profiles ran
    calls = {k: len(v) for k, v in sink.plugins.items()}
    assert calls == {
        ("ProfilePicker", "disagg-profile-handler", "disagg-profile-handler"): 1,
        ("Filter", "decode-filter", "decode-filter"): 1,
        ("Filter", "prefill-filter", "prefill-filter"): 1,
        ("Scorer", "prefix-cache-scorer", "prefix"): 1,
        # One plugin in two profiles: one series, two calls.
        ("Scorer", "active-request-scorer", "active-request-scorer"): 2,
        ("Picker", "max-score-picker", "max-score-picker"): 2,
    }
    assert all(t >= 0 for v in sink.plugins.values() for t in v)
    # The handler's own time excludes the profiles it ran; the whole exceeds every part.
    (handler,) = sink.plugins[("ProfilePicker", "disagg-profile-handler", "disagg-profile-handler")]
    (e2e,) = sink.e2e
    assert handler < e2e and sum(sum(v) for v in sink.plugins.values()) <= e2e
    assert sink.attempts == [("m", want.endpoints[0].address)]
    assert set(timed.profiles) == {"decode", "prefill"}
    # The rest of the Scheduler API is the wrapped scheduler's, with the original plugins.
    assert [type(p) for p in timed.plugins] == [type(p) for p in plain.plugins]
    timed.observe(r, cands(), got)
    timed.responded(r, got, 0.01)


def test_nothing_eligible_is_a_failed_attempt() -> None:
    sink = Sink()
    timed = instrument(build_configured_scheduler(decode_settings(yaml.safe_load(DISAGG))), sink)
    d = timed.schedule(req(), [cand("p1:8000", role="prefill")])
    assert not d.endpoints
    assert sink.attempts == [("m", None)]
    assert len(sink.e2e) == 1


def test_an_explained_decision_carries_the_explaining_scorers_terms_timed_or_not() -> None:
    cfg = decode_settings({})  # the default profile: predicted-ttft-scorer explains itself
    r = req(blocks=4, tokens=2000)
    fleet = [cand("a:8000", prefix=4, waiting=2), cand("b:8000", kv_usage=0.3)]
    for sched in (
        build_configured_scheduler(cfg),
        instrument(build_configured_scheduler(cfg), Sink()),
    ):
        d = sched.schedule(r, fleet, explain=True)
        (name,) = d.terms  # only the scorer that explains: the others give no terms
        assert name == "default/predicted-ttft-scorer"
        assert d.terms[name]["a:8000"]["waiting"] == 2
        assert d.terms[name]["b:8000"]["kv_usage"] == 0.3
        assert not sched.schedule(r, fleet).terms  # not explained: nothing computed
