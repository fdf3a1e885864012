"""Loading scheduling configuration: llm-d's EndpointPickerConfig shape, strict errors that
name the field and line, check-config, third-party plugins."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from extproc.cli import main
from extproc.config import build_configured_scheduler, load_settings
from extproc.errors import ConfigError
from extproc.scheduling.framework import Scheduler

LLMD = textwrap.dedent(
    """\
    apiVersion: llm-d.ai/v1alpha1
    kind: EndpointPickerConfig
    plugins:
    - type: prefix-cache-scorer
      parameters:
        blockSize: 64
        maxPrefixBlocksToMatch: 256
        lruCapacityPerServer: 31250
    - type: queue-scorer
    - type: kv-cache-utilization-scorer
    - type: max-score-picker
    schedulingProfiles:
    - name: default
      plugins:
      - pluginRef: prefix-cache-scorer
        weight: 3
      - pluginRef: queue-scorer
        weight: 2
      - pluginRef: kv-cache-utilization-scorer
        weight: 2
      - pluginRef: max-score-picker
    """
)


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "picker.yaml"
    p.write_text(text)
    return p


def test_llm_d_config_carries_over_unchanged(tmp_path):
    settings = load_settings(write(tmp_path, LLMD))
    scheduler = build_configured_scheduler(settings)
    (profile,) = scheduler.profiles.values()
    assert [(s.name, s.weight) for s in profile.scorers] == [
        ("prefix-cache-scorer", 3.0),
        ("queue-scorer", 2.0),
        ("kv-cache-utilization-scorer", 2.0),
    ]
    assert profile.picker.type_name == "max-score-picker"


def test_no_config_gives_sensible_defaults():
    scheduler = build_configured_scheduler(load_settings(None))
    (profile,) = scheduler.profiles.values()
    assert {s.name for s in profile.scorers} >= {"predicted-ttft-scorer", "no-hit-lru-scorer"}
    assert [f.name for f in profile.filters] == ["bounded-sessions-filter", "bounded-load-filter"]


def test_unknown_plugin_type_names_line_and_field(tmp_path):
    text = LLMD.replace("- type: queue-scorer", "- type: queue-scorr")
    with pytest.raises(ConfigError) as e:
        load_settings(write(tmp_path, text))
    msg = str(e.value)
    assert "picker.yaml:9:" in msg
    assert "plugins[1].type" in msg
    assert "queue-scorr" in msg and "queue-scorer" in msg  # lists the known ones


def test_unknown_parameter_names_line_and_field(tmp_path):
    text = LLMD.replace("lruCapacityPerServer: 31250", "lruCapacityPerServr: 31250")
    with pytest.raises(ConfigError) as e:
        load_settings(write(tmp_path, text))
    assert "picker.yaml:8:" in str(e.value)
    assert "plugins[0].parameters.lruCapacityPerServr: unknown field" in str(e.value)


def test_dangling_plugin_ref_and_bad_weight_are_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"schedulingProfiles\[0\].plugins\[1\].pluginRef"):
        load_settings(write(tmp_path, LLMD.replace("pluginRef: queue-scorer", "pluginRef: nope")))
    with pytest.raises(ConfigError, match="weight: must be positive"):
        load_settings(write(tmp_path, LLMD.replace("weight: 3", "weight: -1")))


def test_our_settings_document_wraps_the_scheduling_section(tmp_path):
    text = "server:\n  fallbacks: 2\nscheduling:\n" + textwrap.indent(LLMD, "  ")
    settings = load_settings(write(tmp_path, text))
    assert settings.server.fallbacks == 2
    bad = "server:\n  fallbacks: 2\n  colour: red\n"
    with pytest.raises(ConfigError, match=r"picker.yaml:3: server.colour: unknown field"):
        load_settings(write(tmp_path, bad))


def test_check_config_command(tmp_path, capsys):
    assert main(["check-config", str(write(tmp_path, LLMD))]) == 0
    assert "OK" in capsys.readouterr().out
    assert (
        main(["check-config", str(write(tmp_path, LLMD.replace("queue-scorer\n", "q\n", 1)))]) == 2
    )
    assert "2 problem(s)" in capsys.readouterr().err  # the type, and the ref to it


PLUGIN_SOURCE = """\
import msgspec


class PreferEvenPorts:
    \"\"\"Scores endpoints on even ports 1.0, odd ones 0.0.\"\"\"

    type_name = "prefer-even-ports"

    class Params(msgspec.Struct, forbid_unknown_fields=True):
        bonus: float = 1.0

    def __init__(self, params):
        self.bonus = params.bonus

    def score(self, req, cands):
        return [self.bonus if c.endpoint.address.endswith(("0", "2", "4", "6", "8")) else 0.0
                for c in cands]
"""


def build_plugin_wheel(out: Path) -> Path:
    """A minimal wheel (a zip with metadata) declaring the plugin under `extproc.plugins`."""
    import zipfile

    dist = "extproc_plugin_example-0.1.dist-info"
    files = {
        "prefer_even.py": PLUGIN_SOURCE,
        f"{dist}/METADATA": ("Metadata-Version: 2.1\nName: extproc-plugin-example\nVersion: 0.1\n"),
        f"{dist}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
        f"{dist}/entry_points.txt": (
            "[extproc.plugins]\nprefer-even-ports = prefer_even:PreferEvenPorts\n"
        ),
    }
    files[f"{dist}/RECORD"] = "".join(f"{n},,\n" for n in [*files, f"{dist}/RECORD"])
    wheel = out / "extproc_plugin_example-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return wheel


def test_third_party_plugin_installed_from_a_package_is_usable(tmp_path):
    """A tiny plugin package, installed by a real installer, named in YAML, changes the pick."""
    wheel = build_plugin_wheel(tmp_path)
    target = tmp_path / "site"
    uv = os.environ.get("UV") or shutil.which("uv")
    assert uv, "uv is needed to install the plugin wheel"
    subprocess.run(
        [
            uv,
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    config = textwrap.dedent(
        """\
        kind: EndpointPickerConfig
        plugins:
        - type: prefer-even-ports
          parameters: {bonus: 1.0}
        schedulingProfiles:
        - name: default
          plugins:
          - pluginRef: prefer-even-ports
        """
    )
    path = write(tmp_path, config)
    probe = textwrap.dedent(
        f"""\
        import sys
        sys.path.insert(0, {str(target)!r})
        from extproc.config import build_configured_scheduler, load_settings
        from extproc.core import Candidate, Endpoint, InferenceRequest
        s = build_configured_scheduler(load_settings({str(path)!r}))
        cands = [Candidate(Endpoint("10.0.0.1:8001")), Candidate(Endpoint("10.0.0.1:8002"))]
        picks = {{s.schedule(InferenceRequest("r", "/"), cands).primary.address for _ in range(20)}}
        print(sorted(picks))
        """
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['10.0.0.1:8002']"


def test_scheduler_requires_a_profile():
    with pytest.raises(ValueError):
        Scheduler(None, [])  # type: ignore[arg-type]


def test_the_plugin_example_in_the_docs_works():
    """docs/plugins.md's ten-line plugin, exactly as printed, builds and scores."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "plugins.md").read_text()
    source = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(source.strip().splitlines()) <= 11
    namespace: dict = {}
    exec(compile(source, "docs/plugins.md", "exec"), namespace)
    cls = namespace["PreferCheapGPUs"]
    from extproc.core import Candidate, Endpoint, InferenceRequest
    from extproc.scheduling.plugins import BUILTINS
    from extproc.scheduling.registry import PluginRegistry

    registry = PluginRegistry([*BUILTINS, cls])
    plugin = registry.build("prefer-cheap-gpus", {"other": 0.1}, ("plugins", 0))
    cands = [
        Candidate(Endpoint("127.0.0.1:1", labels={"gpu": "l4"})),
        Candidate(Endpoint("127.0.0.1:2")),
    ]
    assert plugin.score(InferenceRequest("r", "/"), cands) == [1.0, 0.1]
