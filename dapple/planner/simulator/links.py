"""Links shared between concurrent transfers: max-min fair rates by progressive filling (``link_sharing="shared"``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable


@dataclass(slots=True)
class Flow:
    """A transfer in flight over shared links."""

    work: float  # ms left at full rate
    links: tuple[Hashable, ...]
    payload: object  # what :meth:`SharedLinks.finish` gives back


class SharedLinks:
    """Transfers in flight over unit-capacity links. A transfer's ``work`` is its time alone on its path (ms at
    full rate); while others share one of its links it gets a max-min fair share of that link (every link on a
    path has the same bandwidth class: ``transfers.route_links`` gives device links to intra-server routes only
    and network links to cross-server routes only). :meth:`add` and :meth:`finish` move time to their ``t``."""

    def __init__(self) -> None:
        self.t = 0.0
        self.flows: dict[int, Flow] = {}  # id -> its flow
        self._rate: dict[int, float] = {}  # id -> share of its bottleneck link, in (0, 1]
        self.stale = False  # flows added or removed since the rates were shared out

    @property
    def rate(self) -> dict[int, float]:
        """Each transfer's share of its bottleneck link, in (0, 1] (shared out again after a change)."""
        if self.stale:
            self._fill()
        return self._rate

    def add(self, t: float, fid: int, work: float, links: tuple[Hashable, ...], payload: object) -> None:
        self.advance(t)
        self.flows[fid] = Flow(work, links, payload)
        self.stale = True  # re-shared once time moves on or the next finish is asked for (many start at once)

    def advance(self, t: float) -> None:
        """Move every transfer's progress to time ``t`` at its current rate."""
        dt = t - self.t
        if dt > 0:
            rate = self.rate
            for fid, f in self.flows.items():
                f.work -= rate[fid] * dt
        self.t = max(self.t, t)

    def next_done(self) -> tuple[float, int] | None:
        """(time, id) of the transfer that finishes first at the current rates, or None when idle."""
        rate, best = self.rate, None
        for fid, f in self.flows.items():
            t = self.t + max(f.work, 0.0) / rate[fid]
            if best is None or t < best[0]:
                best = (t, fid)
        return best

    def finish(self, t: float, fid: int) -> object:
        """Remove transfer ``fid`` (done at ``t``; its links are shared out again); returns its payload."""
        self.advance(t)
        payload = self.flows.pop(fid).payload
        self.stale = True
        return payload

    def _fill(self) -> None:
        """Progressive filling: the link with the least capacity per unfrozen transfer fixes their rate."""
        users: dict[Hashable, list[int]] = {}
        for fid, f in self.flows.items():
            for link in f.links:
                users.setdefault(link, []).append(fid)
        left = {link: 1.0 for link in users}
        rate: dict[int, float] = {}
        while len(rate) < len(self.flows):
            share, bottleneck = min((left[link] / n, link) for link, us in users.items()
                                    if (n := sum(1 for u in us if u not in rate)))
            for fid in users[bottleneck]:
                if fid not in rate:
                    rate[fid] = share
                    for link in self.flows[fid].links:
                        left[link] -= share
        self._rate = rate
        self.stale = False
