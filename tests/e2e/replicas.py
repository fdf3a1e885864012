"""Three `extproc serve` replicas on one redis-server behind one Envoy, as the replica e2e
tests start them, with each replica's admin port and metrics at hand."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from extproc.stack import Stack, StackOptions
from tests.e2e.flow_configs import metric_sum
from tests.redis_servers import RedisServer


@dataclass(frozen=True)
class Replicas:
    """A running stack of replicas. `admin`: every replica's admin port, the first picker's
    first."""

    stack: Stack
    http: httpx.Client
    admin: list[int]

    def metric(
        self, name: str, endpoint: str | None = None, *, present: bool = False
    ) -> list[float]:
        """Each replica's sum of metric `name`'s series (those labelled `endpoint` only, when
        given; 0 when it has none, unless `present`: then none fails the test)."""
        if endpoint is None:
            pattern = rf"^{name}(?:{{[^}}]*}})? (\S+)$"
        else:
            pattern = rf'^{name}{{[^}}]*endpoint="{re.escape(endpoint)}"[^}}]*}} (\S+)$'
        return [metric_sum(self.stack, pattern, present=present, admin_port=p) for p in self.admin]

    def metrics_text(self) -> list[str]:
        return [self.http.get(f"http://127.0.0.1:{p}/metrics").text for p in self.admin]


@contextlib.contextmanager
def replicas(
    tmp_path: Path,
    redis: RedisServer,
    picker_yaml: str,
    *,
    upstreams: int = 2,
    sim_args: tuple[str, ...] = (),
    timeout_s: float = 60,
) -> Iterator[Replicas]:
    """Three replicas with `picker_yaml` as their config, `upstreams` sims with `sim_args`."""
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(picker_yaml)
    opts = StackOptions(
        upstreams=upstreams,
        sim_args=sim_args,
        replicas=3,
        redis_url=redis.url,
        extproc_args=("--config", str(cfg)),
    )
    with Stack(opts) as stack, httpx.Client(timeout=timeout_s) as http:
        admin = [stack.picker_admin_port] + [a for _, _, a in stack.replica_ports]
        yield Replicas(stack, http, admin)
