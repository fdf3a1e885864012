"""Three `extproc serve` replicas sharing one redis-server behind one Envoy divide the
simulated servers' scrapes among themselves (`state.shared_scrapes`, `auto` by default,
server/shared_scrapes.py): together they scrape each server about as often as one replica
would, every replica still holds fresh figures of every server, and requests route. With
the replicas not sharing (`false`, the default before), every replica scrapes every
server: three times the scrapes. With Redis killed, the sharing replicas say so
(`extproc_shared_scrapes_degraded`) and each scrapes every server again, its figures
staying fresh. The same run checks that placements are pushed to the peers at decision
time (`state.shared_inflight.push`) and that the push says it is degraded with Redis gone.

On the tenants workload three replicas' scrapes doubled the simulated engines' CPU and
slowed their prefill lanes (bench/RESULTS.md, issue 14, fifteenth session)."""

from __future__ import annotations

import time

from extproc.sim import SERVED_BY_HEADER
from tests.e2e.replicas import Replicas, replicas
from tests.redis_servers import RedisServer

SIM = ("--fast", "4", "--prefill-tps", "5000")
SERVERS = 3
WINDOW_S = 2.0
SHARED = "{}\n"  # the default, `state.shared_scrapes: auto`
UNSHARED = "state: {shared_scrapes: false}\n"


def _scrapes(r: Replicas) -> float:
    return sum(r.metric("extproc_scrapes_total"))


def _rate(r: Replicas) -> float:
    """Scrapes per second, all replicas together, over WINDOW_S."""
    before = _scrapes(r)
    time.sleep(WINDOW_S)
    return (_scrapes(r) - before) / WINDOW_S


def _all_fresh(r: Replicas) -> bool:
    """Every replica's figures of every server are fresh (`extproc_endpoint_stale` 0)."""
    stale = r.metric("extproc_endpoint_stale")
    ages = [len(_series(t, "extproc_endpoint_stale")) for t in r.metrics_text()]
    return all(s == 0 for s in stale) and all(n == SERVERS for n in ages)


def _series(text: str, name: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def _wait(r: Replicas, pred, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, (f"never: {what}", _scrape_lines(r))
        time.sleep(0.2)


def _scrape_lines(r: Replicas) -> list[list[str]]:
    return [[x for x in t.splitlines() if "scrape" in x and not x.startswith("#")]
            for t in r.metrics_text()]  # fmt: skip


def _route(r: Replicas, n: int = 6) -> set[str]:
    served = set()
    for i in range(n):
        text = f"question {i}: " + "ka lo " * 60
        body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": text}]}
        resp = r.http.post(f"{r.stack.url}/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        served.add(resp.headers[SERVED_BY_HEADER])
    return served


def test_replicas_divide_the_scrapes_and_scrape_everything_with_redis_gone(
    tmp_path, redis_server: RedisServer
):
    for d in ("unshared", "shared"):
        (tmp_path / d).mkdir()
    with replicas(
        tmp_path / "unshared", redis_server, UNSHARED, upstreams=SERVERS, sim_args=SIM
    ) as r:
        _wait(r, lambda: _all_fresh(r), "every replica scraping")
        unshared = _rate(r)

    with replicas(tmp_path / "shared", redis_server, SHARED, upstreams=SERVERS, sim_args=SIM) as r:
        # Every server is published by its owner and applied by the two other replicas.
        _wait(
            r,
            lambda: sum(r.metric("extproc_shared_scrapes_applied_total")) > 0,
            "peers' scrapes applied",
        )
        time.sleep(0.5)
        shared = _rate(r)
        assert _all_fresh(r), r.metrics_text()
        assert _route(r), "requests route"
        published = r.metric("extproc_shared_scrapes_published_total")
        assert r.metric("extproc_shared_scrapes_degraded", present=True) == [0, 0, 0]
        # Each placement went to the peers at decision time (endpoints/inflight_push.py),
        # and they counted it before their exchange showed it.
        pushes = r.metric("extproc_inflight_push_published_total")
        pushed = r.metric("extproc_shared_inflight_pushed_arrivals_total")
        assert sum(pushes) >= 6 and sum(pushed) > 0, (pushes, pushed)
        assert r.metric("extproc_inflight_push_degraded", present=True) == [0, 0, 0]

        redis_server.kill()
        _wait(
            r,
            lambda: r.metric("extproc_shared_scrapes_degraded", present=True) == [1, 1, 1],
            "every replica degraded",
        )
        time.sleep(1.0)  # past stale_after_s: each takes over what its peers scraped
        alone = _rate(r)
        assert _all_fresh(r), r.metrics_text()
        # (Not counted as takeovers for certain: once Redis has failed for longer than the
        # in-flight exchange's TTL a replica knows no peers and scrapes everything as a lone
        # one would; which comes first is a race. tests/server/test_shared_scrapes.py counts
        # takeovers with a clock of its own.)
        assert r.metric("extproc_inflight_push_degraded", present=True) == [1, 1, 1]

    why = (unshared, shared, alone, published)
    # One scrape per server per interval for the fleet, not one per replica.
    assert shared < 0.5 * unshared, why
    # The owners passed their scrapes on.
    assert sum(published) > 0, why
    # Redis gone: every replica scrapes every server again.
    assert alone > 2 * shared, why
