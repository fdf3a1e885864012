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
