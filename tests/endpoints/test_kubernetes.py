"""InferencePool discovery against a local server speaking the Kubernetes list/watch API."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from extproc.core import Endpoint
from extproc.endpoints.kubernetes import (
    ApiServer,
    InferencePool,
    InferencePoolSpec,
    InferencePoolWatch,
    LabelSelector,
    ObjectMeta,
    Pod,
    PodCondition,
    PodStatus,
    Port,
    WatchTiming,
    pool_endpoints,
)
from tests.endpoints.fakekube import NS, PODS, POOLS, FakeKube, pod, pool

WAIT_S = 5.0


class Recorder:
    """The `on_change` callback: keeps every delivered set."""

    def __init__(self) -> None:
        self.sets: list[tuple[Endpoint, ...]] = []

    def __call__(self, endpoints: tuple[Endpoint, ...]) -> None:
        self.sets.append(endpoints)

    @property
    def addresses(self) -> list[str]:
        return [e.address for e in self.sets[-1]] if self.sets else []

    async def until(self, pred: Callable[[list[str]], bool]) -> list[str]:
        await until(lambda: bool(self.sets) and pred(self.addresses))
        return self.addresses


class Sleeps:
    """Injected sleep: records the backoff asked for, waits only a moment."""

    def __init__(self) -> None:
        self.delays: list[float] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        await asyncio.sleep(0.01)


async def until(pred: Callable[[], bool]) -> None:
    async with asyncio.timeout(WAIT_S):
        while not pred():
            await asyncio.sleep(0.005)


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    k = FakeKube()
    k.put(POOLS, pool(ports=(8000,)))
    k.put(PODS, pod("a", "10.0.0.1"))
    k.put(PODS, pod("b", "10.0.0.2"))
    await k.start()
    yield k
    await k.stop()


@contextlib.asynccontextmanager
async def watching(
    kube: FakeKube, timing: WatchTiming | None = None
) -> AsyncIterator[tuple[InferencePoolWatch, Recorder, Sleeps]]:
    rec, sleeps = Recorder(), Sleeps()
    timing = timing or WatchTiming()
    watch = InferencePoolWatch(
        ApiServer(kube.url), NS, "pool", rec, timing=timing, sleep=sleeps, rand=lambda: 0.5
    )
    task = asyncio.create_task(watch.run())
    try:
        yield watch, rec, sleeps
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_initial_list_gives_ready_matching_pods() -> None:
    kube = FakeKube()
    kube.put(POOLS, pool())
    kube.put(PODS, pod("a", "10.0.0.1", {"app": "vllm", "llm-d.ai/role": "decode"}))
    kube.put(PODS, pod("other", "10.0.0.9", {"app": "web"}))
    kube.put(PODS, pod("unready", "10.0.0.3", ready=False))
    kube.put(PODS, pod("pending", ""))
    kube.put(PODS, pod("terminating", "10.0.0.4", deleting=True))
    await kube.start()
    try:
        async with watching(kube) as (watch, rec, _):
            assert await rec.until(bool) == ["10.0.0.1:8000"]
            (ep,) = rec.sets[0]
            assert ep.name == "a:8000"
            assert ep.role == "decode"
            assert watch.synced.is_set()
            assert len(rec.sets) == 1
    finally:
        await kube.stop()


async def test_pod_added_modified_and_deleted(kube: FakeKube) -> None:
    async with watching(kube) as (_, rec, _):
        await rec.until(lambda a: a == ["10.0.0.1:8000", "10.0.0.2:8000"])
        kube.put(PODS, pod("c", "10.0.0.3"))
        await rec.until(lambda a: "10.0.0.3:8000" in a)
        kube.put(PODS, pod("c", "10.0.0.33"))  # recreated with a new IP under the same name
        await rec.until(lambda a: "10.0.0.33:8000" in a and "10.0.0.3:8000" not in a)
        kube.delete(PODS, "a")
        assert await rec.until(lambda a: len(a) == 2) == ["10.0.0.2:8000", "10.0.0.33:8000"]


async def test_pod_becoming_unready_or_terminating_leaves_the_set(kube: FakeKube) -> None:
    async with watching(kube) as (_, rec, _):
        await rec.until(lambda a: len(a) == 2)
        kube.put(PODS, pod("a", "10.0.0.1", ready=False))
        await rec.until(lambda a: a == ["10.0.0.2:8000"])
        kube.put(PODS, pod("b", "10.0.0.2", deleting=True))
        await rec.until(lambda a: a == [])
        kube.put(PODS, pod("a", "10.0.0.1"))
        await rec.until(lambda a: a == ["10.0.0.1:8000"])


async def test_only_real_changes_call_back_and_label_changes_count(kube: FakeKube) -> None:
    async with watching(kube) as (_, rec, _):
        await rec.until(lambda a: len(a) == 2)
        kube.put(PODS, pod("web", "10.0.0.7", {"app": "web"}))  # not selected
        kube.put(PODS, pod("a", "10.0.0.1"))  # same content, new resourceVersion
        kube.put(PODS, pod("b", "10.0.0.2", {"app": "vllm", "llm-d.ai/role": "prefill"}))
        await until(lambda: len(rec.sets) >= 2)
        await asyncio.sleep(0.05)
        assert len(rec.sets) == 2
        assert [e.role for e in rec.sets[-1]] == ["", "prefill"]


async def test_bookmark_moves_the_resource_version_used_to_resume(kube: FakeKube) -> None:
    async with watching(kube) as (watch, rec, _):
        await rec.until(lambda a: len(a) == 2)
        await until(lambda: len(kube.watchers) == 2)
        kube.bump(50)  # other objects in the cluster changed
        kube.bookmark()
        await until(lambda: watch.stats.bookmarks == 2)
        kube.end_watches()  # the server's timeoutSeconds ran out
        await until(lambda: len(kube.watch_rvs(PODS)) == 2)
        assert kube.watch_rvs(PODS)[-1] == str(kube.rv)
        assert kube.list_count(PODS) == 1  # resumed, not re-listed
        assert watch.stats.failures == 0


async def test_gone_on_watch_start_relists(kube: FakeKube) -> None:
    async with watching(kube) as (watch, rec, _):
        await rec.until(lambda a: len(a) == 2)
        await until(lambda: len(kube.watchers) == 2)
        kube.drop_watches()
        kube.compact()
        kube.put(PODS, pod("c", "10.0.0.3"))
        await rec.until(lambda a: "10.0.0.3:8000" in a)
        await until(lambda: watch.stats.relists_gone >= 2)
        assert kube.list_count(PODS) == 2
        assert kube.list_count(POOLS) == 2


async def test_gone_as_error_event_relists(kube: FakeKube) -> None:
    async with watching(kube) as (watch, rec, _):
        await rec.until(lambda a: len(a) == 2)
        await until(lambda: len(kube.watchers) == 2)
        kube.gone_in_stream = True
        kube.compact()
        kube.delete(PODS, "b")
        # The delete may reach the open watch first; either way the 410 forces a re-list.
        kube.expire_watches()
        await rec.until(lambda a: a == ["10.0.0.1:8000"])
        await until(lambda: kube.list_count(PODS) == 2 and watch.stats.relists_gone >= 2)
        kube.put(PODS, pod("c", "10.0.0.3"))
        await rec.until(lambda a: a == ["10.0.0.1:8000", "10.0.0.3:8000"])


async def test_dropped_connection_resumes_from_last_version(kube: FakeKube) -> None:
    async with watching(kube) as (_, rec, _):
        await rec.until(lambda a: len(a) == 2)
        await until(lambda: len(kube.watchers) == 2)
        kube.drop_watches()
        await until(lambda: len(kube.watch_rvs(PODS)) == 2)
        kube.put(PODS, pod("c", "10.0.0.3"))
        await rec.until(lambda a: len(a) == 3)
        assert kube.list_count(PODS) == 1


async def test_server_restart_reconnects_with_growing_backoff(
    kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="extproc.endpoints.kubernetes")
    async with watching(kube) as (watch, rec, sleeps):
        await rec.until(lambda a: len(a) == 2)
        await kube.stop()
        await until(lambda: watch.stats.failures >= 8)
        kube.put(PODS, pod("c", "10.0.0.3"))
        kube.compact()  # a restored server no longer knows our resourceVersion
        await kube.start()
        await rec.until(lambda a: len(a) == 3)
        pods_delays = sleeps.delays[:4]
        assert all(d > 0 for d in pods_delays)
        assert max(sleeps.delays) > min(sleeps.delays)  # exponential, not a fixed retry
        assert max(sleeps.delays) <= WatchTiming().max_backoff_s
    # Each failure was said with its delay; the way back is said too (it was not).
    assert "list/watch back after" in caplog.text


def test_backoff_doubles_with_jitter_up_to_the_cap() -> None:
    rolls = iter([0.0, 1.0, 0.0, 1.0])
    timing = WatchTiming(backoff_s=1.0, max_backoff_s=8.0)
    watch = InferencePoolWatch(
        ApiServer("http://x"), NS, "pool", lambda e: None, timing=timing, rand=lambda: next(rolls)
    )
    assert [watch.backoff_s(n) for n in (1, 2, 4, 10)] == [0.5, 2.0, 4.0, 8.0]


async def test_selector_change_on_the_pool_reevaluates(kube: FakeKube) -> None:
    kube.put(PODS, pod("g", "10.0.1.1", {"app": "vllm", "tier": "gold"}))
    async with watching(kube) as (_, rec, _):
        await rec.until(lambda a: len(a) == 3)
        kube.put(POOLS, pool(selector={"app": "vllm", "tier": "gold"}))
        await rec.until(lambda a: a == ["10.0.1.1:8000"])
        assert kube.list_count(PODS) == 1


async def test_multiple_target_ports_give_one_endpoint_each(kube: FakeKube) -> None:
    async with watching(kube) as (_, rec, _):
        await rec.until(lambda a: len(a) == 2)
        kube.put(POOLS, pool(ports=(8000, 8001)))
        addrs = await rec.until(lambda a: len(a) == 4)
        assert addrs == ["10.0.0.1:8000", "10.0.0.1:8001", "10.0.0.2:8000", "10.0.0.2:8001"]
        assert [e.name for e in rec.sets[-1]][:2] == ["a:8000", "a:8001"]


async def test_missing_then_deleted_pool() -> None:
    kube = FakeKube()
    kube.put(PODS, pod("a", "10.0.0.1"))
    await kube.start()
    try:
        async with watching(kube) as (watch, rec, _):
            await until(lambda: watch.synced.is_set())
            assert rec.sets == [()]
            kube.put(POOLS, pool())
            await rec.until(lambda a: a == ["10.0.0.1:8000"])
            kube.delete(POOLS, "pool")
            await rec.until(lambda a: a == [])
    finally:
        await kube.stop()


async def test_list_follows_pages(kube: FakeKube) -> None:
    for i in range(3, 8):
        kube.put(PODS, pod(f"p{i}", f"10.0.0.{i}"))
    async with watching(kube, WatchTiming(page_size=2)) as (_, rec, _):
        assert len(await rec.until(lambda a: len(a) == 7)) == 7
        assert kube.list_count(PODS) == 4
        assert len(rec.sets) == 1


async def test_unknown_api_is_retried_with_backoff() -> None:
    kube = FakeKube()  # no InferencePool CRD route answers for another namespace
    await kube.start()
    try:
        sleeps = Sleeps()
        watch = InferencePoolWatch(ApiServer(kube.url), "elsewhere", "pool", lambda e: None,
                                   sleep=sleeps, rand=lambda: 0.5)  # fmt: skip
        task = asyncio.create_task(watch.run())
        await until(lambda: watch.stats.failures >= 4)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not watch.synced.is_set()
    finally:
        await kube.stop()


async def test_kubeconfig_token_reaches_the_server(kube: FakeKube, tmp_path: Path) -> None:
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": {"server": kube.url}}],
        "users": [{"name": "u", "user": {"token": "s3cret"}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u", "namespace": NS}}],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(cfg))
    api = await ApiServer.load({"KUBECONFIG": str(path)})
    rec = Recorder()
    watch = InferencePoolWatch(api, NS, "pool", rec)
    task = asyncio.create_task(watch.run())
    try:
        await rec.until(lambda a: len(a) == 2)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert set(kube.auth) == {"Bearer s3cret"}


def test_in_cluster_reads_service_account_files(tmp_path: Path) -> None:
    from extproc.endpoints.kubernetes import in_cluster_namespace

    (tmp_path / "token").write_text("tok")
    (tmp_path / "namespace").write_text("llm\n")
    ca = tmp_path / "ca.crt"
    ca.write_text(_SELF_SIGNED_PEM)
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    api = ApiServer.in_cluster(env, token_path=str(tmp_path / "token"), ca_path=str(ca))
    assert api.url == "https://10.96.0.1:443"
    assert api.ssl_context is not None
    headers = asyncio.run(api.headers())
    assert headers["Authorization"] == "Bearer tok"
    assert in_cluster_namespace(str(tmp_path / "namespace")) == "llm"


def test_an_unreadable_token_shows_on_metrics_and_is_said_once_a_minute(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token file gone unreadable falls back to the last token, counted per connection
    on /metrics; the warning is rate-limited (once a minute), not repeated at every list
    and watch, and the next line carries how many it left out in `suppressed_since_last`."""
    import extproc.throttle
    from extproc.server.families import API_SERVER

    now = [1000.0]  # the throttle's clock only (asyncio keeps the real one)
    monkeypatch.setattr(extproc.throttle, "time", SimpleNamespace(monotonic=lambda: now[0]))

    token = tmp_path / "token"
    token.write_text("tok")
    ca = tmp_path / "ca.crt"
    ca.write_text(_SELF_SIGNED_PEM)
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    api = ApiServer.in_cluster(env, token_path=str(token), ca_path=str(ca))
    token.unlink()

    async def connect_thrice() -> list[str]:
        return [(await api.headers())["Authorization"] for _ in range(3)]

    def failures() -> list[float]:
        fam = next(
            f for f in API_SERVER.families(api.stats)
            if f.name == "extproc_discovery_token_read_failures"
        )  # fmt: skip
        return [s.value for s in fam.samples]

    assert asyncio.run(connect_thrice()) == ["Bearer tok"] * 3
    assert failures() == [3]
    said = [r for r in caplog.records if "token unreadable" in r.getMessage()]
    assert [r.__dict__["suppressed_since_last"] for r in said] == [0]

    now[0] += 59.0  # within the minute: counted, not said
    assert asyncio.run(connect_thrice()) == ["Bearer tok"] * 3
    said = [r for r in caplog.records if "token unreadable" in r.getMessage()]
    assert len(said) == 1
    now[0] += 2.0  # past it: one line, saying the five left out since the first
    assert asyncio.run(api.headers())["Authorization"] == "Bearer tok"
    said = [r for r in caplog.records if "token unreadable" in r.getMessage()]
    assert [r.__dict__["suppressed_since_last"] for r in said] == [0, 5]
    assert failures() == [7]


async def test_pods_with_an_unusable_ip_show_on_metrics_and_are_said_once(
    kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    """A Ready pod whose podIP makes no address is left out: the gauge says how many at
    the last recompute, the warning comes once per pod, not at every pod event."""
    from extproc.server.families import WATCH

    def gauge(watch: InferencePoolWatch) -> float:
        fam = next(
            f for f in WATCH.families(watch.stats)
            if f.name == "extproc_discovery_unusable_pods"
        )  # fmt: skip
        return fam.samples[0].value

    kube.put(PODS, pod("bad", "10.0.0.300"))
    async with watching(kube) as (watch, rec, _):
        assert await rec.until(lambda a: len(a) == 2) == ["10.0.0.1:8000", "10.0.0.2:8000"]
        assert gauge(watch) == 1
        kube.put(PODS, pod("c", "10.0.0.3"))
        await rec.until(lambda a: len(a) == 3)
        assert gauge(watch) == 1
        kube.delete(PODS, "bad")
        await until(lambda: gauge(watch) == 0)
    said = [r for r in caplog.records if "unusable podIP" in r.getMessage()]
    assert len(said) == 1 and "bad" in said[0].getMessage()


def _pod(name: str, ip: str, labels: dict[str, str]) -> Pod:
    return Pod(
        ObjectMeta(name=name, labels=labels),
        PodStatus(podIP=ip, conditions=[PodCondition("Ready", "True")]),
    )


def test_pool_endpoints_brackets_ipv6_and_skips_shared_addresses() -> None:
    p = InferencePool(spec=InferencePoolSpec(LabelSelector({"app": "m"}), [Port(8000)]))
    pods = [
        _pod("v6", "fd00::1", {"app": "m"}),
        _pod("host-a", "192.168.1.5", {"app": "m"}),
        _pod("host-b", "192.168.1.5", {"app": "m"}),
    ]
    eps = pool_endpoints(p, pods)
    assert [(e.address, e.name) for e in eps] == [
        ("192.168.1.5:8000", "host-a:8000"),
        ("[fd00::1]:8000", "v6:8000"),
    ]


def test_empty_selector_selects_nothing() -> None:
    p = InferencePool(spec=InferencePoolSpec(LabelSelector({}), [Port(8000)]))
    assert pool_endpoints(p, [_pod("a", "10.0.0.1", {"app": "m"})]) == ()


# A throwaway self-signed certificate (CN=test), only parsed as a CA bundle, never trusted.
_SELF_SIGNED_PEM = """\
-----BEGIN CERTIFICATE-----
MIIBdTCCARugAwIBAgIUZmFeYfRZzPNBUYZmoaTIDeUfD5swCgYIKoZIzj0EAwIw
DzENMAsGA1UEAwwEdGVzdDAgFw0yNjExMjkxNzI5NTZaGA8yMTI2MTEwNTE3Mjk1
NlowDzENMAsGA1UEAwwEdGVzdDBZMBMGByqGSM49AgEGCCqGSM49AwEHA0IABLSI
C4+sZ0c5l6w34GmTXI5OXn2CT+J1zO0NwPCQkKOq42+J0OqL19N5TpGQSVRJnko+
1rtNPkURMnh8nftFYJKjUzBRMB0GA1UdDgQWBBRSlNVTuNhshzI5vWCIQIA93DZQ
kTAfBgNVHSMEGDAWgBRSlNVTuNhshzI5vWCIQIA93DZQkTAPBgNVHRMBAf8EBTAD
AQH/MAoGCCqGSM49BAMCA0gAMEUCIQDIofx+iwjq+BblVSfWNAyCLloBDjOXxrQZ
46e6MtqDJAIgVvGybWvLhCwKnaTA8BdJ5ogvmeGZx4fNQDs6/8VBJCQ=
-----END CERTIFICATE-----
"""
