"""bench/overload_timeline.py: each row carries every picker's bytes per token and
engine-blocks ratio, so a calibration change of unit (flow control's ratios follow it) or a
swing of the measured ratio shows in a run's timeline at the sample it happened."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.bench_modules import bench_modules

PAGES = {
    9001: "extproc_approx_bytes_per_token 1.0\nextproc_flow_engine_blocks_ratio 0.7791\n",
    9002: "# no calibration here\nextproc_approx_bytes_per_token 4.0\n",
}


def test_a_row_has_each_pickers_unit_and_ratio(tmp_path: Path):
    def page(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text=PAGES[request.url.port or 0])

    with bench_modules("overload_timeline") as (timeline,):
        tl = timeline.Timeline(list(PAGES), [], tmp_path / "timeline.jsonl")
        with httpx.Client(transport=httpx.MockTransport(page)) as client:
            row = tl._sample(client, 1.0, {})
    assert row["bpt_each"] == [1.0, 4.0]
    assert row["eb_ratio_each"] == [0.7791, 0.0]  # 0: not exported by that picker
