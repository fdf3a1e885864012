"""Helpers on the shapes in extproc/core.py."""

from __future__ import annotations

from extproc.core import common_prefix_blocks


def test_common_prefix_blocks_of_chained_keys():
    assert common_prefix_blocks((1, 2, 3, 4), (1, 2, 3, 4)) == 4
    assert common_prefix_blocks((1, 2, 3, 4), (1, 2, 9, 9, 9)) == 2
    assert common_prefix_blocks((1, 2, 3, 4), (1, 2, 3, 4), 3) == 3  # up to the limit
    assert common_prefix_blocks((1, 2, 3, 4), (5,)) == 0
    assert common_prefix_blocks((1, 2), (1, 2, 3)) == 2
    assert common_prefix_blocks((), (1,)) == 0
    assert common_prefix_blocks((7,), (7, 8), 0) == 0
