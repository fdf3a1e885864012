"""In-flight counts cover the whole request: through a real Envoy whose ext_proc stream ends
at the response headers, the picker keeps counting a streamed reply until Envoy's access log
says it ended."""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from extproc.stack import Stack, StackOptions, wait_until
from tests.e2e.flow_configs import metric_sum
from tests.e2e.test_flow_eviction_cut import sim_figure


def picker_metric(stack: Stack, name: str) -> float:
    """The sum of the picker's series of metric `name` (0 when it has none)."""
    return metric_sum(stack, rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", present=False)


@pytest.fixture(scope="module")
def slow_stack():
    # One sim whose sequences decode at 10 tokens/s: 60 output tokens stream for ~6 s.
    opts = StackOptions(upstreams=1, sim_args=("--decode-tps", "10", "--chat-max-tokens", "60"))
    with Stack(opts) as s:
        yield s


def story(stack: Stack, prompt: str) -> dict:
    """A streamed chat request for 60 tokens: ~6 s of reply from the slow simulator."""
    return {
        "model": stack.fleet.model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 60,
        "stream": True,
    }


def log_flowing(stack: Stack, http: httpx.Client) -> None:
    """A first request opens Envoy's access-log stream: auto mode holds placements (and
    calibration waits for each request's end) once entries arrive."""
    body = {**story(stack, "hello"), "stream": False, "max_tokens": 1}
    http.post("/v1/chat/completions", json=body)
    wait_until(
        lambda: picker_metric(stack, "extproc_access_log_entries_total") >= 1,
        timeout_s=10,
        what="the first access-log entry",
    )


def test_inflight_count_lasts_until_a_streamed_reply_ends(slow_stack: Stack):
    stack = slow_stack
    body = story(stack, "tell me a long story")
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        log_flowing(stack, http)
        assert picker_metric(stack, "extproc_inflight_requests") == 0
        samples: list[tuple[float, float]] = []
        done = threading.Event()
        chunks: list[float] = []

        def stream() -> None:
            with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                for _ in resp.iter_lines():
                    chunks.append(time.monotonic())
            done.set()

        t = threading.Thread(target=stream)
        start = time.monotonic()
        t.start()
        while not done.wait(0.3):
            if chunks:  # response headers are through: the ext_proc stream has ended
                value = picker_metric(stack, "extproc_inflight_requests")
                samples.append((time.monotonic(), value))
        t.join()
        streamed_s = chunks[-1] - chunks[0]
        assert streamed_s > 4.0, f"the reply streamed for {streamed_s:.1f} s only"
        # Samples taken while tokens were still arriving (a sample after the last chunk may
        # already see the end).
        during = [v for at, v in samples if at < chunks[-1]]
        assert len(during) >= 3 and set(during) == {1.0}, samples
        wait_until(
            lambda: picker_metric(stack, "extproc_inflight_requests") == 0,
            timeout_s=5,
            what="in-flight count back to 0 after the reply",
        )
        assert picker_metric(stack, "extproc_request_end_expired_total") == 0
        # The held streamed request was released by its entry (a RequestEndStats field that
        # reaches /metrics through server/families.py).
        assert picker_metric(stack, "extproc_request_end_ended_total") >= 1
        assert time.monotonic() - start < 20


def test_a_client_that_hangs_up_mid_stream_is_a_cut_not_a_completion(slow_stack: Stack):
    """Envoy logs a client that hangs up mid-stream with the 200 it had already sent; only
    its response flags (downstream connection termination) say the client left. The engine
    never counts a cut request (vLLM, the simulator), so calibration must leave it out of its
    pairing: counted cut at its end, not paired as a completion whose engine count never
    comes until the stale bound drops it."""
    stack = slow_stack
    body = story(stack, "tell me a story I will not finish")
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        log_flowing(stack, http)
        cut = picker_metric(stack, "extproc_approx_pairing_cut_total")
        finished = sim_figure(stack, "request_success_total")
        start = time.monotonic()
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            first = next(line for line in resp.iter_lines() if line.startswith("data:"))
            assert "chat.completion.chunk" in first
        # Leaving the block closed the connection with ~5 s of the reply still to come.
        wait_until(
            lambda: client_cuts(stack) == 1, timeout_s=5, what="the hang-up counted as a cut"
        )
        assert picker_metric(stack, "extproc_approx_pairing_cut_total") == cut + 1
        assert time.monotonic() - start < 4  # ended by the hang-up, not by the reply's end
        wait_until(
            lambda: picker_metric(stack, "extproc_inflight_requests") == 0,
            timeout_s=5,
            what="in-flight count back to 0 after the hang-up",
        )
        # The premise: the engine aborted it, and counts it as no finished request.
        assert sim_figure(stack, "request_success_total") == finished


def client_cuts(stack: Stack) -> float:
    return metric_sum(
        stack, r'^extproc_request_end_cut_total{reason="client"} (\S+)$', present=False
    )
