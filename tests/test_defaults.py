"""Each default is defined once: the settings take the index's own defaults instead of
repeating them (issue 19: tier weights and capacity had drifted apart)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from extproc.config import DEFAULT_CAPACITY_BLOCKS, Settings
from extproc.index.base import DEFAULT_TIER_WEIGHTS, IndexOptions

PACKAGE = Path(__file__).resolve().parents[1] / "extproc"
SOURCES = {p: p.read_text() for p in PACKAGE.rglob("*.py") if "_proto" not in p.parts}


@pytest.mark.parametrize(
    "pattern",
    [
        r'"GPU":\s*1\.0',  # the tier weights
        r"\b500_000\b",  # the served index's capacity per endpoint
        r"(budget_s|BUDGET_S)[^=\n]*=\s*0\.005\b",  # the Redis lookup budget
        r"stale_after_s[^=\n]*=\s*0\.2\b|STALE_AFTER_S\s*=\s*0\.2\b",  # stale scraped figures
    ],
)
def test_a_default_literal_appears_once(pattern: str):
    where = [str(p.relative_to(PACKAGE)) for p, text in SOURCES.items() if re.search(pattern, text)]
    assert len(where) == 1, where


def test_settings_take_the_index_defaults():
    index = Settings().index
    assert index.tier_weights == dict(DEFAULT_TIER_WEIGHTS)
    assert index.approx_ttl_s == IndexOptions().approx_ttl_s
    assert index.capacity_blocks == DEFAULT_CAPACITY_BLOCKS


def test_envoy_config_points_at_the_picker_default_port():
    """bootstrap sits below config (it may not import it), so its default picker address
    restates the port; this keeps the two equal."""
    from extproc.bootstrap import BootstrapOptions

    assert BootstrapOptions().extproc == f"127.0.0.1:{Settings().server.port}"


def test_cli_help_shows_the_settings_defaults():
    from extproc.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    helps = {a.dest: a.help for a in serve._actions}
    server = Settings().server
    assert f"(default {server.port})" in helps["port"]
    assert f"(default {server.admin_port})" in helps["admin_port"]


def test_default_sections_are_not_shared_between_settings():
    # Frozen structs still hold lists and dicts: a section shared by every Settings() would
    # let one mutation change every other instance's defaults.
    a, b = Settings(), Settings()
    assert a.index.tier_weights is not b.index.tier_weights
    assert a.server.allowed_clients is not b.server.allowed_clients
    assert a.index.tier_weights is not DEFAULT_TIER_WEIGHTS
    a.index.tier_weights["gpu"] = 0.0
    assert b.index.tier_weights == DEFAULT_TIER_WEIGHTS
