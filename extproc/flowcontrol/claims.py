"""Room kept for a higher band's request that is waiting for it (`flow_control.
waiting_claims_room`, opt-in).

Why: with per-endpoint admission a request is released only where a server has room for
it. A large request of a higher band (the overload bench's tenant C: ~2.7k picker tokens)
that finds no server with room waits in the picker until enough ends on one; the reserve
(flowcontrol/reserve.py) and its refill credit (flowcontrol/refill.py) bound that wait to
about the time a server takes to free the difference. But its band's newer, smaller
requests went on being released meanwhile: the band's fairness policy picks them first
(C is over its token share: its requests are large) and each one fits in what has freed,
on the very server the large one waits for. The large one's wait was then 0.4-1.6 s
instead of at most the refill horizon, and those requests set the band's TTFT p99
(bench/RESULTS.md, fourteenth session: a C request waited 0.65 s while a B and an A that
arrived after it went at once).

So in a band above the lowest (those a reserve is kept for), a request that found no room
is marked waiting: at every dispatch opportunity the band's waiting requests are tried
first, oldest first, whatever the fairness policy says; one that still does not fit
claims the server where it comes closest to fitting (the most room left after it), and
its tokens count as placed there for the rest of that opportunity. The band's other
requests are then picked by its fairness policy as before, and go where they fit besides
the claimed room (elsewhere, or on the same server if both fit), or wait. Lower bands wait
anyway while the band has queued work (strict priority). Fairness still orders everything
that fits at once; only the order of the requests the band's servers cannot take yet is
arrival.

With replicas sharing flow state (flowcontrol/shared.py) each publishes its last
opportunity's claims, and a peer counts them as placed for its requests of the claiming
replica's top band and below (one exchange interval old: the claim of a request released
meanwhile is counted twice for at most that long, on the safe side), except for its own
waiting requests: the replicas' arrival order is unknown, and two waiting requests each
counting the other's claim on one server would both wait for room for two. Waiting requests
at different replicas take room as it frees, as without the setting; newer ones keep off
everyone's claims.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


class Claims:
    """This dispatch opportunity's claims, the last one's (published), and the peers'. Event
    loop only."""

    __slots__ = ("claimed", "last", "made", "peers")

    def __init__(self) -> None:
        self.claimed: dict[str, int] = {}  # this opportunity: address -> tokens
        self.last: dict[str, int] = {}  # the last opportunity's (published to peers)
        # Per peer: its top queued band and its claims (address -> tokens).
        self.peers: list[tuple[int, dict[str, int]]] = []
        self.made = 0  # claims made (a waiting request, one dispatch opportunity each)

    def begin(self) -> None:
        self.claimed = {}

    def claim(self, address: str, tokens: int) -> None:
        self.claimed[address] = self.claimed.get(address, 0) + tokens
        self.made += 1

    def end(self) -> None:
        self.last, self.claimed = self.claimed, {}

    def against(self, priority: int, peers: bool = True) -> dict[str, int]:
        """Tokens per server kept from a request of `priority`: this opportunity's claims
        (its band's waiting requests, older) and, with `peers`, the peers' of bands at or
        above it."""
        out = dict(self.claimed)
        for band, theirs in self.peers if peers else ():
            if priority <= band:
                for a, t in theirs.items():
                    out[a] = out.get(a, 0) + t
        return out

    def published(self) -> dict[str, int]:
        return dict(self.last)

    def peers_seen(self, peers: Sequence[tuple[int, Mapping[str, int]]]) -> None:
        self.peers = [(b, dict(m)) for b, m in peers if m]
