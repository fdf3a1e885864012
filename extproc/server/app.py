"""The process: the parts built from Settings (server/assembly.py), run by the lifecycle
(server/lifecycle.py), their stats exported at every scrape (server/exporter.py).

`async with App(settings, endpoints) as app: await app.serve()`; `app.stop()` (what SIGTERM
calls) marks health NOT_SERVING, lets open streams finish within `grace_s`, then tears down
in reverse order: servers -> loops -> queued index writes -> clients.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from extproc.config import Settings
from extproc.core import Endpoint
from extproc.server import exporter
from extproc.server.assembly import build_index
from extproc.server.lifecycle import Lifecycle

__all__ = ["App", "build_index"]


class App(Lifecycle):
    def __init__(
        self,
        settings: Settings,
        endpoints: Sequence[Endpoint],
        *,
        environ: Mapping[str, str] | None = None,
        shared_ports: bool = False,
    ) -> None:
        """`environ` is only read for Kubernetes credentials (in-cluster service account or
        $KUBECONFIG); the CLI passes the process environment. `shared_ports`: a `--workers`
        worker, whose ext_proc and health ports are shared with its siblings (SO_REUSEPORT);
        otherwise a second process on the same port is a conflict."""
        super().__init__(settings, endpoints, environ=environ, shared_ports=shared_ports)
        exporter.register(self, self.ready, self.kube_watches)

    async def __aenter__(self) -> App:
        await super().__aenter__()
        return self
