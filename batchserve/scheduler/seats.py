"""Seats per tenant: while another tenant waits for a seat, no tenant holds more than its share.

A seat is one of `SchedulerConfig.max_num_seqs` running requests. Prompts give seats up on their
own (a background tenant's prompt is preempted for a foreground one, `fairness.py`), but decodes
run to their end: one tenant's long decodes would hold every seat for minutes while another
tenant's one-token request waits. So each step, before anything is scheduled:

- the share is the seats divided evenly among the tenants with requests: a tenant with waiting
  requests *wants* seats up to the share rounded down (at least one), and holds at most the share
  rounded up while another wants one;
- where the free seats do not cover what is wanted, the tenant furthest over its share gives up its
  youngest request (preempted: it recomputes its prompt and output when readmitted, which is
  lossless here, and cached blocks shorten it), until the wants are covered or no one is over;
- admission then seats the wanting tenants' requests before a tenant at its share takes a seat.

A tenant alone, or tenants each within their share, see plain first come, first served. A tenant
that is already background (`fairness.py`) wants no seats: its prompts take only what others
leave, never a decode's seat. Pure Python.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from batchserve.request import Request


@dataclass(slots=True)
class SeatShares:
    """One step's seats per tenant (see the module doc). `share`: the most a tenant holds while
    another wants a seat; `held`: running requests per tenant; `wanted`: seats each tenant under
    its share waits for."""

    seats: int
    share: int
    held: Counter[str] = field(default_factory=Counter)
    wanted: Counter[str] = field(default_factory=Counter)

    @classmethod
    def of(
        cls, running: Iterable[Request], waiting: Iterable[Request], seats: int, background: frozenset[str]
    ) -> SeatShares:
        held = Counter(r.tenant for r in running)
        queued = Counter(r.tenant for r in waiting)
        tenants = len(held.keys() | queued.keys())
        share, fair = -(-seats // max(1, tenants)), max(1, seats // max(1, tenants))
        wanted: Counter[str] = Counter()
        for tenant, count in queued.items():
            if tenant not in background and held[tenant] < fair:
                wanted[tenant] = min(count, fair - held[tenant])
        return cls(seats, share, held, wanted)

    @property
    def free(self) -> int:
        return self.seats - sum(self.held.values())

    def victims(self, running: Sequence[Request]) -> list[Request]:
        """Running requests (`running` in arrival order) to preempt so the wanted seats are free:
        each the youngest of the tenant furthest over its share."""
        need = sum(self.wanted.values()) - max(0, self.free)
        held, out = Counter(self.held), []
        while need > 0:
            tenant, count = max(held.items(), key=lambda kv: kv[1], default=("", 0))
            if count <= self.share:
                break
            out.append(next(r for r in reversed(running) if r.tenant == tenant and r not in out))
            held[tenant] -= 1
            need -= 1
        return out  # the caller preempts them (`gave_up` counts each)

    def may_take(self, req: Request) -> bool:
        """Whether `req` may take a seat now: no tenant wants one, its tenant does, or the free seats
        exceed what the tenants under their share still want."""
        wants = sum(self.wanted.values())
        return wants == 0 or self.wanted[req.tenant] > 0 or self.free > wants

    def took(self, req: Request) -> None:
        self.held[req.tenant] += 1
        if self.wanted[req.tenant] > 0:
            self.wanted[req.tenant] -= 1

    def gave_up(self, req: Request) -> None:
        self.held[req.tenant] -= 1
