"""The gateway table is data, the docs print it, and real Envoy accepts every bootstrap."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from extproc.bootstrap import BootstrapOptions
from extproc.gateways import GATEWAYS, gateway_bootstrap
from extproc.stack import envoy_binary

ROOT = Path(__file__).resolve().parents[2]
OPTS = BootstrapOptions(endpoints=("10.0.0.1:8000", "10.0.0.2:8000"), admin_port=9901)


@pytest.mark.parametrize("gw", GATEWAYS, ids=lambda g: g.name)
def test_docs_table_has_a_row_citing_the_source(gw):
    rows = [r for r in (ROOT / "docs/gateways.md").read_text().splitlines() if r.startswith("|")]
    (row,) = [r for r in rows if r.startswith(f"| `{gw.name}` ")]
    project, _, files = gw.source.partition(": ")
    assert project.split(" (")[0].split(" ")[0] in row or "the same file" in row
    for f in files.split(", "):
        assert f.split(" (")[0] in row or "the same file" in row, f


@pytest.mark.parametrize("gw", GATEWAYS, ids=lambda g: g.name)
def test_real_envoy_validates_the_gateway_bootstrap(gw, tmp_path):
    doc = gateway_bootstrap(gw, OPTS)
    ext = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (f,) = [x for x in ext["typed_config"]["http_filters"] if "ext_proc" in x["name"]]
    mode = f["typed_config"]["processing_mode"]
    assert (mode["request_body_mode"], mode["response_body_mode"]) == (
        gw.request_body,
        gw.response_body,
    )
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--log-level", "error"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
