"""The process: the parts built from Settings (server/assembly.py), run by the lifecycle
(server/lifecycle.py), their stats exported at every scrape (server/exporter.py through the
tables of server/families.py).

`async with App(settings, endpoints) as app: await app.serve()`; `app.stop()` (what SIGTERM
calls) marks health NOT_SERVING, lets open streams finish within `grace_s`, then tears down
in reverse order: servers -> loops -> queued index writes -> clients.
"""

from __future__ import annotations

from extproc.server.assembly import build_index
from extproc.server.lifecycle import Lifecycle

__all__ = ["App", "build_index"]


class App(Lifecycle):
    """One picker process: `App(settings, endpoints, environ=..., shared_ports=...)`.
    `environ` is only read for Kubernetes credentials (in-cluster service account or
    $KUBECONFIG) and build info; the CLI passes the process environment. `shared_ports`: a
    `--workers` worker, whose ext_proc and health ports are shared with its siblings
    (SO_REUSEPORT); otherwise a second process on the same port is a conflict."""
