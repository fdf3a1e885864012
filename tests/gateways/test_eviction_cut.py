"""Eviction of a response under way under settings other than `--response-trailers send`
where Envoy 1.40 keeps the ext_proc stream to the response's end: the gateways' own
(extproc/gateways.py: response bodies FULL_DUPLEX_STREAMED and trailers sent; Istio's here,
llm-d's and the AI Gateway's differ only in what does not matter to the cut), and our
config with a BUFFERED request body (`BootstrapOptions.request_body_mode`; response body
NONE, trailers SKIP: with a buffered request body Envoy does not close the stream at the
response headers)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import pytest

from extproc.bootstrap import BootstrapOptions, build_bootstrap
from extproc.gateways import ISTIO, gateway_bootstrap
from extproc.stack import Stack, StackOptions
from tests.e2e.test_flow_eviction_cut import SIM, cuts_the_newest_sheddable_response, picker_config

pytestmark = pytest.mark.e2e


def istio(opts: BootstrapOptions) -> dict[str, Any]:
    return gateway_bootstrap(ISTIO, opts)


def buffered(opts: BootstrapOptions) -> dict[str, Any]:
    return build_bootstrap(replace(opts, request_body_mode="BUFFERED"))


SETTINGS: dict[str, tuple[Callable[[BootstrapOptions], dict[str, Any]], str]] = {
    "istio": (istio, "override-host"),
    "ours-buffered": (buffered, "original-dst"),
}


@pytest.fixture(params=sorted(SETTINGS))
def stack(request, tmp_path) -> Iterator[Stack]:
    boot, lb = SETTINGS[request.param]
    args = picker_config(tmp_path)
    opts = StackOptions(upstreams=1, lb=lb, sim_args=SIM, extproc_args=args, bootstrap=boot)
    with Stack(opts) as s:
        yield s


async def test_a_sheddable_response_under_way_is_cut(stack: Stack):
    await cuts_the_newest_sheddable_response(stack)
