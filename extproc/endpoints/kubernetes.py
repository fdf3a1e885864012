"""Endpoint discovery from a Kubernetes InferencePool: list+watch the pool and the Pods of its
namespace, and hand every change of the Ready endpoint set to a callback (usually
`EndpointPool.replace`). Kubernetes JSON stops here; past this module only `Endpoint`s travel.

We speak the list/watch protocol over aiohttp ourselves, read the in-cluster service account
ourselves, and use `kubernetes_asyncio` (the optional `kubernetes` extra) only to load a
kubeconfig with its exec/OIDC plugins when running outside a cluster. Its generated
`Watch` hides what this loop must control (resumption from a resourceVersion, bookmarks, 410
Gone -> re-list) and its OpenAPI models cost far more per Pod than one msgspec decode.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Generic, Protocol, TypeVar
from urllib.parse import urlencode

import aiohttp
import msgspec

from extproc.backoff import backoff_s
from extproc.core import Endpoint
from extproc.endpoints.pool import normalize_address
from extproc.errors import ConfigError
from extproc.throttle import Throttle

log = logging.getLogger(__name__)

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
ROLE_LABEL = "llm-d.ai/role"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

OnChange = Callable[[tuple[Endpoint, ...]], None]
Sleep = Callable[[float], Awaitable[None]]

# Lines of a watch stream are single JSON objects; a Pod is rarely past 100 KiB, so this only
# stops a misbehaving server from growing the buffer without end.
_MAX_LINE_BYTES = 16 << 20


# --- the door: only the fields we read, decoded strictly typed --------------------------------


class ObjectMeta(msgspec.Struct, frozen=True):
    name: str = ""
    resourceVersion: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    deletionTimestamp: str | None = None


class PodCondition(msgspec.Struct, frozen=True):
    type: str
    status: str


class PodStatus(msgspec.Struct, frozen=True):
    podIP: str = ""
    conditions: list[PodCondition] = msgspec.field(default_factory=list)


class Pod(msgspec.Struct, frozen=True):
    metadata: ObjectMeta = ObjectMeta()
    status: PodStatus = PodStatus()

    @property
    def is_ready(self) -> bool:
        """Routable: Ready=True, not terminating, and an IP to send to."""
        if self.metadata.deletionTimestamp is not None or not self.status.podIP:
            return False
        return any(c.type == "Ready" and c.status == "True" for c in self.status.conditions)


class LabelSelector(msgspec.Struct, frozen=True):
    matchLabels: dict[str, str] = msgspec.field(default_factory=dict)


class Port(msgspec.Struct, frozen=True):
    number: int


class InferencePoolSpec(msgspec.Struct, frozen=True):
    selector: LabelSelector = LabelSelector()
    targetPorts: list[Port] = msgspec.field(default_factory=list)


class InferencePool(msgspec.Struct, frozen=True):
    metadata: ObjectMeta = ObjectMeta()
    spec: InferencePoolSpec = InferencePoolSpec()


class _ListMeta(msgspec.Struct, frozen=True):
    resourceVersion: str = ""
    continue_: str = msgspec.field(default="", name="continue")


class PodList(msgspec.Struct, frozen=True):
    metadata: _ListMeta = _ListMeta()
    items: list[Pod] = msgspec.field(default_factory=list)


class InferencePoolList(msgspec.Struct, frozen=True):
    metadata: _ListMeta = _ListMeta()
    items: list[InferencePool] = msgspec.field(default_factory=list)


class _Status(msgspec.Struct, frozen=True):
    code: int = 0
    reason: str = ""
    message: str = ""


class _Bare(msgspec.Struct, frozen=True):
    metadata: ObjectMeta = ObjectMeta()


class _Event(msgspec.Struct, frozen=True):
    type: str
    object: msgspec.Raw


class _Named(Protocol):
    """A listed object: Pod, InferencePool, InferenceObjective, ..."""

    @property
    def metadata(self) -> ObjectMeta: ...


T = TypeVar("T", bound=_Named)


class _Page(Protocol[T]):
    """One page of a list answer (PodList, InferencePoolList, ...)."""

    @property
    def metadata(self) -> _ListMeta: ...

    @property
    def items(self) -> list[T]: ...


class _Owner(Protocol):
    """What a _Reflector needs from the watch that owns it."""

    api: ApiServer
    timing: WatchTiming
    stats: WatchStats
    sleep: Sleep
    rand: Callable[[], float]

    def backoff_s(self, failures: int) -> float: ...

    def _publish(self) -> None: ...


@dataclass(frozen=True, slots=True)
class PoolSelection:
    """What an InferencePool selects: its endpoints, and the names of the Ready matching
    pods left out because their podIP makes no address (a bad or odd CNI value)."""

    endpoints: tuple[Endpoint, ...]
    unusable: tuple[str, ...] = ()


def pool_endpoints(pool: InferencePool | None, pods: Iterable[Pod]) -> tuple[Endpoint, ...]:
    """The endpoints an InferencePool selects (see `select_pool`)."""
    return select_pool(pool, pods).endpoints


def select_pool(pool: InferencePool | None, pods: Iterable[Pod]) -> PoolSelection:
    """One endpoint per Ready matching pod and target port, `podIP:port`, named `pod:port`,
    with the pod's labels (roles come from `llm-d.ai/role`), sorted by name so equal sets
    compare equal; and the pods skipped for an unusable podIP. Pure: the caller says and
    counts what was skipped."""
    if pool is None:
        return PoolSelection(())
    selector = pool.spec.selector.matchLabels
    if not selector:
        # The CRD requires 1-64 labels; an empty selector would otherwise match the whole
        # namespace, so it selects nothing instead.
        return PoolSelection(())
    ports = [p.number for p in pool.spec.targetPorts]
    out: dict[str, Endpoint] = {}
    unusable: list[str] = []
    for pod in sorted(pods, key=lambda p: p.metadata.name):
        labels = pod.metadata.labels
        if not pod.is_ready or any(labels.get(k) != v for k, v in selector.items()):
            continue
        frozen_labels = MappingProxyType(dict(labels))
        for port in ports:
            try:
                address = normalize_address(f"{_bracket(pod.status.podIP)}:{port}")
            except ConfigError:
                unusable.append(pod.metadata.name)
                break
            # Two hostNetwork pods on one node share an IP: keep the first, Envoy can only
            # be told an address.
            out.setdefault(address, Endpoint(address, f"{pod.metadata.name}:{port}", frozen_labels))
    return PoolSelection(tuple(out.values()), tuple(unusable))


def _bracket(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def endpoint_identity(endpoints: Iterable[Endpoint]) -> tuple[tuple[Any, ...], ...]:
    """What makes two endpoint sets different: `Endpoint` equality ignores labels, but a role
    change must reach the scheduler."""
    return tuple((e.address, e.name, tuple(sorted(e.labels.items()))) for e in endpoints)


# --- credentials ------------------------------------------------------------------------------


@dataclass(slots=True)
class ApiServerStats:
    """Counters since start. `token_read_failures`: connections that found the in-cluster
    service-account token unreadable and sent the last one read (it may have expired: 401s
    follow once it does)."""

    token_read_failures: int = 0


class ApiServer:
    """How to reach one Kubernetes API server: base URL, TLS, and the Authorization header,
    asked for on every (re)connection because projected service-account tokens rotate."""

    def __init__(
        self,
        url: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        authorization: Callable[[], Awaitable[str | None]] | None = None,
        stats: ApiServerStats | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.ssl_context = ssl_context
        self._authorization = authorization
        self.stats = stats if stats is not None else ApiServerStats()

    async def headers(self) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if self._authorization is not None and (value := await self._authorization()):
            h["Authorization"] = value
        return h

    @classmethod
    def from_configuration(cls, cfg: Any) -> ApiServer:
        """From a `kubernetes_asyncio.client.Configuration` filled by one of its loaders."""
        ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert)
        if cfg.cert_file:
            ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
        if not cfg.verify_ssl:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE

        async def authorization() -> str | None:
            # Runs the loader's refresh hook (the in-cluster one re-reads the token file).
            token = await cfg.get_api_key_with_prefix("BearerToken")
            if token:
                return str(token)
            if cfg.username or cfg.password:
                return str(cfg.get_basic_auth_token())
            return None

        secure = cfg.host.startswith("https:")
        return cls(cfg.host, ssl_context=ctx if secure else None, authorization=authorization)

    @classmethod
    def in_cluster(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        token_path: str = f"{SERVICE_ACCOUNT_DIR}/token",
        ca_path: str = f"{SERVICE_ACCOUNT_DIR}/ca.crt",
    ) -> ApiServer:
        """The pod's service account: API address from `KUBERNETES_SERVICE_HOST/PORT` in
        `environ` (the caller passes `os.environ`), token and CA from the mounted files.
        The token file is re-read on every connection: projected tokens rotate (about
        hourly), and a cached one would start failing with 401s."""
        env = dict(environ or {})
        host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise ConfigError(
                "kubernetes in-cluster config: KUBERNETES_SERVICE_HOST/PORT are not set"
            )
        try:
            ctx = ssl.create_default_context(cafile=ca_path)
            token = _read_token(token_path)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"kubernetes in-cluster config: {exc}") from None
        if not token:
            raise ConfigError(f"kubernetes in-cluster config: {token_path} is empty")

        stats = ApiServerStats()
        # Every list and watch (re)connection reads the token: an unreadable file would
        # otherwise repeat its line on each of them, and on every backoff retry.
        throttle = Throttle(every_s=60.0)

        async def authorization() -> str | None:
            try:
                return f"Bearer {_read_token(token_path)}"
            except OSError as exc:
                stats.token_read_failures += 1
                throttle.warn(
                    log, "token", "service-account token unreadable, using the last one: %s", exc
                )
                return f"Bearer {token}"

        url = f"https://{_bracket(host)}:{port}"
        return cls(url, ssl_context=ctx, authorization=authorization, stats=stats)

    @classmethod
    async def from_kubeconfig(
        cls, path: str | None = None, context: str | None = None
    ) -> ApiServer:
        """A kubeconfig file (default `~/.kube/config`), for running outside the cluster.
        Kubeconfig files have many credential kinds (exec plugins, OIDC, client certs), so
        this path uses the `kubernetes` extra (`pip install 'extproc[kubernetes]'`); a pod
        needs nothing beyond the base install."""
        try:
            from kubernetes_asyncio.client import Configuration
            from kubernetes_asyncio.config import ConfigException, load_kube_config
        except ImportError:
            raise ConfigError(
                "reading a kubeconfig needs the kubernetes extra: pip install 'extproc[kubernetes]'"
            ) from None

        cfg = Configuration()
        try:
            await load_kube_config(
                config_file=path, context=context, client_configuration=cfg, persist_config=False
            )
        except (ConfigException, OSError) as exc:
            raise ConfigError(f"kubeconfig: {exc}") from None
        return cls.from_configuration(cfg)

    @classmethod
    async def load(cls, environ: Mapping[str, str], kubeconfig: str | None = None) -> ApiServer:
        """In-cluster when running in a pod and no kubeconfig is named, else the kubeconfig
        (`kubeconfig`, then `$KUBECONFIG`, then `~/.kube/config`)."""
        if kubeconfig is None and environ.get("KUBERNETES_SERVICE_HOST"):
            return cls.in_cluster(environ)
        return await cls.from_kubeconfig(kubeconfig or environ.get("KUBECONFIG"))


def _read_token(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def in_cluster_namespace(path: str = f"{SERVICE_ACCOUNT_DIR}/namespace") -> str | None:
    """The namespace this pod runs in, a sensible default for `--namespace`."""
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


# --- list + watch -----------------------------------------------------------------------------


class _Gone(Exception):
    """410: the resourceVersion we hold was compacted away; only a fresh list helps."""


class _ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass(slots=True)
class WatchStats:
    """Counters for metrics and tests. `failures` counts passes that ended in an error."""

    lists: int = 0
    watches: int = 0
    relists_gone: int = 0
    failures: int = 0
    bookmarks: int = 0
    changes: int = 0
    # InferencePool watch only: Ready matching pods left out at the last recompute for an
    # unusable podIP (a gauge; see InferencePoolWatch._say_unusable).
    unusable_pods: int = 0


@dataclass(frozen=True, slots=True)
class WatchTiming:
    """`watch_timeout_s`: the server closes each watch after this long (times 1-2, randomized
    like client-go so replicas do not reconnect in step); reconnecting from the last
    resourceVersion is free. `idle_timeout_s`: no byte for this long means a dead connection.
    `request_timeout_s` bounds a list. Backoff after a failure: `backoff_s` doubling up to
    `max_backoff_s`, each delay scaled by a random factor in [0.5, 1]."""

    watch_timeout_s: float = 300.0
    idle_timeout_s: float = 120.0
    request_timeout_s: float = 30.0
    backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    page_size: int = 500


class _Reflector(Generic[T]):
    """List then watch one resource collection into `items` (by name), calling `changed`
    after every list and event. Holds on to the resourceVersion across reconnects."""

    def __init__(
        self,
        owner: _Owner,
        kind: str,
        path: str,
        item_type: type[T],
        list_type: type[_Page[T]],
        params: Mapping[str, str],
    ) -> None:
        self._owner = owner
        self._kind = kind
        self._path = path
        self._type = item_type
        self._list_type = list_type
        self._params = dict(params)
        self.items: dict[str, T] = {}
        self.synced = False
        self.resource_version: str | None = None

    async def run(self, session: aiohttp.ClientSession) -> None:
        owner = self._owner
        failures = 0
        while True:
            try:
                if self.resource_version is None:
                    async with asyncio.timeout(owner.timing.request_timeout_s):
                        await self._list(session)
                    failures = self._back(failures)
                if await self._watch(session):
                    failures = self._back(failures)
                else:
                    # A watch that ends before saying anything would make this a busy loop.
                    failures += 1
                    await owner.sleep(owner.backoff_s(failures))
            except _Gone:
                owner.stats.relists_gone += 1
                log.info("%s watch: resourceVersion expired (410), re-listing", self._kind)
                self.resource_version = None
            except Exception as exc:
                failures += 1
                owner.stats.failures += 1
                delay = owner.backoff_s(failures)
                if isinstance(exc, aiohttp.ClientError | TimeoutError | _ApiError):
                    log.warning("%s list/watch failed (%s), retry in %.1fs", self._kind, exc, delay)
                else:
                    log.exception("%s list/watch failed, retry in %.1fs", self._kind, delay)
                await owner.sleep(delay)

    def _back(self, failures: int) -> int:
        """A list or watch went through: after failures (each said with its retry delay),
        say that the endpoint set follows the API server again. Returns the new count, 0."""
        if failures:
            log.info("%s list/watch back after %d failed attempts", self._kind, failures)
        return 0

    async def _get(
        self, session: aiohttp.ClientSession, params: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        api = self._owner.api
        resp = await session.get(
            f"{api.url}{self._path}?{urlencode(params)}",
            headers=await api.headers(),
            ssl=api.ssl_context if api.ssl_context is not None else True,
        )
        if resp.status == 200:
            return resp
        async with resp:
            body = await resp.read()
        status = _decode_status(body)
        if resp.status == 410 or status.code == 410:
            raise _Gone(status.message)
        raise _ApiError(resp.status, status.message or resp.reason or "")

    async def _list(self, session: aiohttp.ClientSession) -> None:
        items: dict[str, T] = {}
        params = {**self._params, "limit": str(self._owner.timing.page_size)}
        while True:
            async with await self._get(session, params) as resp:
                page = msgspec.json.decode(await resp.read(), type=self._list_type)
            items.update((i.metadata.name, i) for i in page.items)
            if not page.metadata.continue_:
                break
            params["continue"] = page.metadata.continue_
        self._owner.stats.lists += 1
        # Swapped in whole, so a re-list never shows a half-empty set in between.
        self.items = items
        self.resource_version = page.metadata.resourceVersion
        self.synced = True
        self._owner._publish()

    async def _watch(self, session: aiohttp.ClientSession) -> bool:
        """One watch request from `resource_version`; True when the stream carried data."""
        timing = self._owner.timing
        server_timeout = int(timing.watch_timeout_s * (1 + self._owner.rand()))
        params = {
            **self._params,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "resourceVersion": self.resource_version or "",
            "timeoutSeconds": str(server_timeout),
        }
        self._owner.stats.watches += 1
        async with asyncio.timeout(server_timeout + timing.request_timeout_s):
            async with await self._get(session, params) as resp:
                buf = bytearray()
                received = False
                while True:
                    try:
                        async with asyncio.timeout(timing.idle_timeout_s):
                            chunk = await resp.content.readany()
                    except TimeoutError:
                        log.info("%s watch idle, reconnecting", self._kind)
                        return True
                    if not chunk:
                        return received  # the server ended the watch; resume from rv
                    received = True
                    buf += chunk
                    while (nl := buf.find(b"\n")) >= 0:
                        line = bytes(buf[:nl])
                        del buf[: nl + 1]
                        if line.strip():
                            self._apply(msgspec.json.decode(line, type=_Event))
                    if len(buf) > _MAX_LINE_BYTES:
                        raise _ApiError(200, "watch event too large")

    def _apply(self, event: _Event) -> None:
        if event.type == "ERROR":
            status = msgspec.json.decode(event.object, type=_Status)
            if status.code == 410:
                raise _Gone(status.message)
            raise _ApiError(status.code, status.message)
        if event.type == "BOOKMARK":
            self._owner.stats.bookmarks += 1
            rv = msgspec.json.decode(event.object, type=_Bare).metadata.resourceVersion
            self.resource_version = rv or self.resource_version
            return
        item = msgspec.json.decode(event.object, type=self._type)
        if event.type in ("ADDED", "MODIFIED"):
            self.items[item.metadata.name] = item
        elif event.type == "DELETED":
            self.items.pop(item.metadata.name, None)
        else:
            log.warning("%s watch: unknown event type %r", self._kind, event.type)
        self.resource_version = item.metadata.resourceVersion or self.resource_version
        self._owner._publish()


def _decode_status(body: bytes) -> _Status:
    try:
        return msgspec.json.decode(body, type=_Status)
    except msgspec.DecodeError:
        return _Status(message=body[:200].decode(errors="replace"))


class InferencePoolWatch:
    """Background loop: the Ready endpoints of InferencePool `namespace/name`.

    `on_change` receives the whole new set (a tuple sorted by name) each time it really
    changes (addresses, names or labels), first once both the pool and the pods are listed.
    A missing pool gives the empty set. Pods are watched namespace-wide and matched here, so
    a selector or port change on the pool applies without a re-list. `synced` is set after
    the first delivery (readiness can wait on it). `sleep` and `rand` are injectable so tests
    need not wait out backoffs. Runs until cancelled; the aiohttp session is its own.
    """

    def __init__(
        self,
        api: ApiServer,
        namespace: str,
        name: str,
        on_change: OnChange,
        *,
        timing: WatchTiming = WatchTiming(),
        sleep: Sleep = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.name = name
        self.timing = timing
        self.sleep = sleep
        self.rand = rand
        self.stats = WatchStats()
        self.synced = asyncio.Event()
        self._on_change = on_change
        self._last: tuple[tuple[Any, ...], ...] | None = None
        self._had_pool: bool | None = None
        self._unusable: frozenset[str] = frozenset()
        self._pools = _Reflector(
            self,
            "InferencePool",
            f"/apis/{POOL_GROUP}/{POOL_VERSION}/namespaces/{namespace}/inferencepools",
            InferencePool,
            InferencePoolList,
            {"fieldSelector": f"metadata.name={name}"},
        )
        self._pods = _Reflector(
            self, "Pod", f"/api/v1/namespaces/{namespace}/pods", Pod, PodList, {}
        )

    def backoff_s(self, failures: int) -> float:
        t = self.timing
        return backoff_s(failures, t.backoff_s, t.max_backoff_s, self.rand())

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timing.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session, asyncio.TaskGroup() as tg:
            tg.create_task(self._pools.run(session), name="inferencepool-watch")
            tg.create_task(self._pods.run(session), name="pod-watch")

    def _say_unusable(self, unusable: tuple[str, ...], pods: Mapping[str, Pod]) -> None:
        # A gauge of the pods skipped at the last recompute, not a counter of skips: the
        # same pod is skipped again at every pod event until it changes, so a counter would
        # count events, not pods. Said once per pod, when it starts being skipped.
        self.stats.unusable_pods = len(unusable)
        for name in sorted(set(unusable) - self._unusable):
            pod = pods.get(name)
            ip = pod.status.podIP if pod is not None else None
            log.warning("pod %s: unusable podIP %r; left out of the pool", name, ip)
        self._unusable = frozenset(unusable)

    def _publish(self) -> None:
        if not (self._pools.synced and self._pods.synced):
            return
        pool = self._pools.items.get(self.name)
        if pool is None and self._had_pool is not False:
            log.warning("InferencePool %s/%s not found: no endpoints", self.namespace, self.name)
        self._had_pool = pool is not None
        selected = select_pool(pool, self._pods.items.values())
        self._say_unusable(selected.unusable, self._pods.items)
        endpoints = selected.endpoints
        key = endpoint_identity(endpoints)
        if key == self._last:
            return
        self._last = key
        self.stats.changes += 1
        log.info("InferencePool %s/%s: %d endpoint(s)", self.namespace, self.name, len(endpoints))
        self._on_change(endpoints)
        self.synced.set()
