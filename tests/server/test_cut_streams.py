"""The registry of streams held open for eviction: a drain ends each once and holds none
after, and how many are held is a gauge (the e2e proof behind Envoy:
tests/e2e/test_flow_eviction_drain.py)."""

from __future__ import annotations

import logging

from extproc.server.cut_streams import CutStreams


def test_a_drain_ends_every_held_stream_and_holds_no_new_one(caplog):
    cuts = CutStreams()
    ended: list[str] = []
    a, b, c = (lambda n=n: ended.append(n) for n in "abc")
    assert cuts.hold(a) and cuts.hold(b) and cuts.hold(c)
    cuts.drop(c)  # its stream ended by itself first
    with caplog.at_level(logging.INFO, logger="extproc.server.cut_streams"):
        assert cuts.release_all() == 2
    assert sorted(ended) == ["a", "b"]
    assert "ended 2 cuttable ext_proc streams" in caplog.text
    assert not cuts.hold(c)  # draining: the stream ends at its headers instead
    assert cuts.release_all() == 0 and sorted(ended) == ["a", "b"]


def test_the_held_streams_are_a_gauge():
    cuts = CutStreams()

    def value() -> list[float]:
        return [s.value for f in cuts.collect() for s in f.samples]

    assert value() == [0]
    a, b = (lambda: None), (lambda: None)
    cuts.hold(a), cuts.hold(b)
    assert value() == [2]
    cuts.drop(a)
    assert value() == [1]
    cuts.release_all()
    assert value() == [0]
