"""The reserve's refill credit from the decode's start (`flow_control.reserve_refill_credit:
started`), behind a real Envoy: `extproc serve` with per-endpoint admission, a reserve for
one interactive request, a token-mode concurrency detector and two simulated vLLM servers.

What tells it from `predicted`: a request placed on a server but still waiting in its engine
(here: the server slowed almost to a stop before it arrives, so it sits in its prefill) is
not credited, though its placement predicts its end within the horizon; so a batch request
that would leave that server short of the reserve without the credit is held. Once the
server runs again and a scrape shows the request past its first token, its end (its output
times the measured per-token decode time from that scrape) falls within the horizon: the
batch request is let in on its credit. Before, the picker says the decode time measured
(its log line), from interactive requests sent while others ran (their room checks read the
scrapes that time each one's first token); the servers export the first-token count, so no
credit falls back to placement (`unstarted` stays 0)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from extproc.endpoints.scrape import ScrapeSettings
from extproc.flowcontrol.refill import ARRIVAL_S, SCRAPE_GAP_S
from extproc.flowcontrol.reserve import QUANTILE_TRUSTED
from extproc.sim import SERVED_BY_HEADER
from extproc.stack import SimFleet, Stack
from tests.e2e.flow_configs import (
    HI,
    LO,
    held_or_done,
    metric_sum,
    queued,
    refill_credit_stack,
    reserve_body,
    reserve_estimate,
    start_streaming,
)
from tests.e2e.sim_speed import finish_fast

HORIZON_S = 1.5
OUT = 200  # expected_output_tokens: a request counts min(OUT, max_tokens) of output
SHORT_OUT = 20  # the interactive requests: ~0.4 s of decode at 50 tokens/s
# The request beside which the batch request asks: ~0.8 s of decode, so placement predicts
# its end within the horizon for that long after it is placed (when `predicted` credits it),
# and once decoding its end is within the horizon however late the scrape that shows it.
X_OUT = 40
LONG = 2000  # the filler's output: ~40 s, never credited
HI_WORDS, FILL_WORDS, Q_WORDS, X_WORDS = 50, 300, 150, 150  # ~2 tokens per word
RESERVE = reserve_estimate(HI_WORDS) + SHORT_OUT  # the interactive band's requests
# A request asking for room counts its prompt and output; once placed, its prompt.
Q = reserve_estimate(Q_WORDS) + 1
X = reserve_estimate(X_WORDS)
FILL = reserve_estimate(FILL_WORDS)
# Beside X, Q fits under the ceiling but leaves that server short of the reserve by half of
# it: Q goes in only on a credit for X (the filler leaves the other server no room).
CAP = X + Q + RESERVE // 2
PACE_S = 0.05  # between interactive sends: each one's room check reads a fresh scrape
STOPPED = 1e-4  # a server's speed while X waits there: its 304-token prefill takes ~15 s


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("flowrefillstarted")
    with refill_credit_stack(tmp, CAP, "started", HORIZON_S, OUT) as s:
        yield s


def set_speed(fleet: SimFleet, names: set[str], speed: float) -> None:
    for srv in fleet.servers:
        if srv.name in names:
            r = httpx.post(f"{srv.url}/sim/speed", json={"relative_speed": speed}, timeout=5)
            r.raise_for_status()


def decode_measured(stack: Stack) -> bool:
    """Whether the picker has said the per-token decode time measured."""
    log = (stack.log_dir / "extproc.log").read_text(errors="replace")
    return "per-output-token decode time measured" in log


async def held_after_scrapes(stack: Stack, q: asyncio.Task, rounds: int = 3) -> bool:
    """Whether `q` (a queued batch request) is still queued once the picker has scraped
    every server `rounds` more times (so its latest scrape of each was taken at least
    `rounds - 1` scrape intervals after now) and then found no room for `q` twice more
    (two room checks reading those scrapes). Polls every 20 ms, up to 100 times."""

    def count(name: str) -> float:
        return metric_sum(stack, rf"^{name} (\S+)$")

    scrapes = await asyncio.to_thread(count, "extproc_scrapes_total")
    until = scrapes + rounds * len(stack.fleet.servers)
    checks: float | None = None
    for _ in range(100):
        if q.done() or not await asyncio.to_thread(queued, stack, 0):
            return False
        if checks is None:
            if await asyncio.to_thread(count, "extproc_scrapes_total") >= until:
                checks = await asyncio.to_thread(count, "extproc_flow_no_endpoint_room_total")
        elif await asyncio.to_thread(count, "extproc_flow_no_endpoint_room_total") >= checks + 2:
            return await asyncio.to_thread(queued, stack, 0) == 1 and not q.done()
        await asyncio.sleep(0.02)
    raise AssertionError("the picker did not scrape and check the held request's room")


async def test_credits_a_request_from_its_decode_start_not_its_placement(stack: Stack):
    # The stack scrapes often enough that the scrapes around a first token are close enough
    # to time the decode from (several reads within SCRAPE_GAP_S, one past ARRIVAL_S).
    assert ScrapeSettings().interval_s <= min(SCRAPE_GAP_S / 2, ARRIVAL_S)
    assert min(Q, X, RESERVE) > CAP - FILL  # the filler's server takes no more
    assert CAP - X - OUT >= RESERVE and 0 <= CAP - X - Q < RESERVE
    model = stack.fleet.model
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:

        async def post(body: dict, headers: dict) -> httpx.Response:
            return await c.post("/v1/chat/completions", json=body, headers=headers)

        # The interactive band's history (QUANTILE_TRUSTED sizes) and the decode time:
        # requests sent PACE_S apart, so each runs while later ones' room checks read the
        # scrapes before and after its first token. Sent until the picker says it measured.
        sent: list[asyncio.Task[httpx.Response]] = []
        while len(sent) < QUANTILE_TRUSTED or not decode_measured(stack):
            assert len(sent) < 3 * QUANTILE_TRUSTED, "the decode time was never measured"
            body = reserve_body(model, 100 + len(sent), HI_WORDS, SHORT_OUT)
            sent.append(asyncio.create_task(post(body, HI)))
            await asyncio.sleep(PACE_S)
        assert all(r.status_code == 200 for r in await asyncio.gather(*sent))

        filler, full = await start_streaming(c, model, 300, FILL_WORDS, LONG, LO)
        others = {s.name for s in stack.fleet.servers} - {full}
        # X will wait in its engine: its server all but stopped before X gets there (a
        # streamed reply's headers leave before the prefill, so it is placed and answering).
        set_speed(stack.fleet, others, STOPPED)
        x, other = await start_streaming(c, model, 301, X_WORDS, X_OUT, LO)
        assert other in others
        # Placement predicts X's end within the horizon (`predicted` would let Q in now);
        # its engine shows it before its first token: no credit, Q is held. (Let in, Q would
        # not end either: it too would wait in that engine. The picker's queue tells.)
        q = asyncio.create_task(post(reserve_body(model, 302, Q_WORDS, 1), LO))
        await held_or_done(stack, q)
        assert queued(stack, 0) == 1, "let in beside a request placed just before it"
        # Held too once the picker has read a scrape judging X (taken ARRIVAL_S or more
        # after its placement) and checked Q's room by it: X's engine has it prefilling.
        assert await held_after_scrapes(stack, q), "let in beside one waiting in its engine"
        # X's server runs again: a scrape shows X decoding, its end within the horizon.
        set_speed(stack.fleet, others, 1.0)
        let_in = await asyncio.wait_for(q, 10)
        assert let_in.status_code == 200 and let_in.headers[SERVED_BY_HEADER] == other
        # The credit it was let in on: X's room (nothing else runs there).
        assert metric_sum(stack, r"^extproc_flow_reserve_refill_tokens (\S+)$") >= X
        # Every server's scrapes had the first-token count: none credited from placement.
        assert metric_sum(stack, r"^extproc_flow_reserve_refill_unstarted_total (\S+)$") == 0
        assert not filler.done(), "the filler ended too soon"
        finish_fast(stack.fleet)
        assert await filler == 200 and await x == 200
