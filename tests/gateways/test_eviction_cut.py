"""Eviction under the gateways' own ext_proc settings (extproc/gateways.py): response bodies
FULL_DUPLEX_STREAMED and trailers sent, so the stream lasts to the response's end and a
sheddable response under way is cut as behind `--response-trailers send` (Istio's settings
here; llm-d's and the AI Gateway's differ only in what does not matter to the cut)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from extproc.bootstrap import BootstrapOptions
from extproc.gateways import ISTIO, gateway_bootstrap
from extproc.stack import Stack, StackOptions
from tests.e2e.test_flow_eviction_cut import SIM, cuts_the_newest_sheddable_response, picker_config

pytestmark = pytest.mark.e2e


def istio(opts: BootstrapOptions) -> dict[str, Any]:
    return gateway_bootstrap(ISTIO, opts)


@pytest.fixture(scope="module")
def istio_stack(tmp_path_factory) -> Iterator[Stack]:
    args = picker_config(tmp_path_factory.mktemp("cut-istio"))
    opts = StackOptions(
        upstreams=1, lb="override-host", sim_args=SIM, extproc_args=args, bootstrap=istio
    )
    with Stack(opts) as s:
        yield s


async def test_istio_settings_cut_a_sheddable_response_under_way(istio_stack: Stack):
    await cuts_the_newest_sheddable_response(istio_stack)
