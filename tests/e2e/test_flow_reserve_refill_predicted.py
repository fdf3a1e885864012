"""The reserve's refill credit from predicted ends (`flow_control.reserve_refill_credit:
predicted`), behind a real Envoy: `extproc serve` with per-endpoint admission, a reserve for
one interactive request, a token-mode concurrency detector and two simulated vLLM servers.

The credit counts the requests on a server whose end, predicted from their counted output
times the per-output-token time of the recent ends, falls within the horizon. Until enough
ends have measured that time the picker says so and credits the ends' rate. Then, with a
long batch request filling one server, a short batch request is let onto the other beside a
request about to end there (its room counted as coming back), and held beside a request of
the same size that streams on (nothing there predicted to end: no credit)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from extproc.flowcontrol.refill import SPEED_TRUSTED
from extproc.flowcontrol.reserve import QUANTILE_TRUSTED
from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack
from tests.e2e.flow_configs import (
    HI,
    LO,
    held_or_done,
    inflight_ended,
    metric_sum,
    refill_credit_stack,
    reserve_body,
    reserve_estimate,
    start_streaming,
)
from tests.e2e.sim_speed import finish_fast

HORIZON_S = 0.5
OUT = 200  # expected_output_tokens: a request counts min(OUT, max_tokens) of output
SHORT_OUT = 20  # at 50 tokens/s: ~0.4 s, an end within the horizon
# Counted OUT: predicted ~4 s out (not within the horizon for the test's ~3 s; then it
# would be, though it streams on: its end is predicted from its counted output).
LONG = 2000
# Words of 7 letters (~2 tokens each): the interactive band's requests, the batch request
# that fills one server, the one let in or held, and the one beside it on the other server
# (about to end, or streaming on).
HI_WORDS, FILL_WORDS, Q_WORDS, X_WORDS = 50, 300, 150, 150
# A request counts its prompt alone, asking for room as once placed (the detector has no
# `outputTokens` here; its counted output only times its predicted end).
RESERVE = reserve_estimate(HI_WORDS)  # the interactive band's requests
Q = reserve_estimate(Q_WORDS)
X = reserve_estimate(X_WORDS)
FILL = reserve_estimate(FILL_WORDS)
# Beside either, Q fits under the ceiling but leaves that server short of the reserve by
# half of it (the other half: room for the reserve's arrival-rate term, kept small below).
CAP = X + Q + RESERVE // 2


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("flowrefillpredicted")
    with refill_credit_stack(tmp, CAP, "predicted", HORIZON_S, OUT) as s:
        yield s


def unpredicted(stack: Stack) -> float:
    return metric_sum(stack, r"^extproc_flow_reserve_refill_unpredicted_total (\S+)$")


async def test_credits_the_room_of_requests_predicted_to_end_within_the_horizon(stack: Stack):
    model = stack.fleet.model
    # The filler (placed on an idle server, though larger than the ceiling) leaves it too
    # little for any batch request or the reserve.
    assert min(Q, X, RESERVE) > CAP - FILL
    # On the other server, the reserve is there beside X alone, and short beside X and Q.
    assert CAP - X >= RESERVE and 0 <= CAP - X - Q < RESERVE
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:

        async def post(body: dict, headers: dict) -> httpx.Response:
            return await c.post("/v1/chat/completions", json=body, headers=headers)

        def interactive(seed: int) -> dict:
            return reserve_body(model, seed, HI_WORDS, SHORT_OUT)

        assert (await post(interactive(100), HI)).status_code == 200
        # Under a reserve, before enough ends measured the per-token time: said and counted.
        assert (await post(reserve_body(model, 200, Q_WORDS, SHORT_OUT), LO)).status_code == 200
        assert unpredicted(stack) >= 1
        # The band's history (and, with these ends, the per-token time: SPEED_TRUSTED).
        assert QUANTILE_TRUSTED > SPEED_TRUSTED
        sent = [post(interactive(101 + i), HI) for i in range(QUANTILE_TRUSTED)]
        assert all(r.status_code == 200 for r in await asyncio.gather(*sent))
        await inflight_ended(stack)
        measured = unpredicted(stack)

        filler, full = await start_streaming(c, model, 300, FILL_WORDS, LONG, LO)

        # Beside a request predicted to end within the horizon: let in.
        ending, other = await start_streaming(c, model, 301, X_WORDS, SHORT_OUT, LO)
        assert other != full
        let_in = await post(reserve_body(model, 302, Q_WORDS, 1), LO)
        assert let_in.status_code == 200 and let_in.headers[SERVED_BY_HEADER] == other
        # The credit it was let in on: the ending request's room (nothing else ran there).
        assert metric_sum(stack, r"^extproc_flow_reserve_refill_tokens (\S+)$") >= X
        assert await ending == 200
        await asyncio.sleep(0.3)  # its access-log entry

        # Beside one as large that streams on: held (nothing there is predicted to end).
        streaming, there = await start_streaming(c, model, 303, X_WORDS, LONG, LO)
        assert there == other
        held = asyncio.create_task(post(reserve_body(model, 304, Q_WORDS, 1), LO))
        await held_or_done(stack, held)
        assert not held.done(), "let in with nothing there predicted to end"
        assert not filler.done() and not streaming.done(), "a long request ended too soon"
        assert unpredicted(stack) == measured  # predicted from the measured time since
        finish_fast(stack.fleet)
        assert await filler == 200 and await streaming == 200
        assert (await held).status_code == 200
