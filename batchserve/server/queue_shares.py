"""The waiting queue's places per tenant: when it is full, the 429 goes to a tenant over its share.

A call holds places in the waiting queue from admission (its samples, tokenized or not) until its
first output. With the queue full, a call of a tenant within its share (the limit divided evenly
among the tenants holding places, the caller's included) takes the places of the youngest calls of
a tenant over its share that are still in preparation or waiting, never started: those end with the refusal the
newcomer would have had (RESOURCE_EXHAUSTED, HTTP 429), before any byte of an answer was sent, so
their clients retry as from any full queue. A tenant over its share is refused itself. One
flooding tenant then never keeps another out of the queue, and no tenant loses work it has begun.

`per_tenant` caps what one tenant holds whether or not the queue is full. Without API keys a
tenant is whatever string a client sends: a client sending many gets many shares (see the trust
model in docs/serving.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class QueuedCall:
    """One call's places: `count` requests of `tenant`, and their engine ids once submitted."""

    tenant: str
    count: int
    request_ids: list[str] = field(default_factory=list)
    displaced: bool = False  # its places went to another tenant's call: it ends refused
    released: bool = False


@dataclass(slots=True)
class TenantQueues:
    """The calls holding places, in admission order, and each tenant's places."""

    limit: int
    per_tenant: int | None = None
    held: Counter[str] = field(default_factory=Counter)
    calls: list[QueuedCall] = field(default_factory=list)

    def over_cap(self, tenant: str, count: int) -> bool:
        """Whether `count` more places would take `tenant` past the per-tenant cap."""
        return self.per_tenant is not None and self.held[tenant] + count > self.per_tenant

    def share(self, tenant: str) -> float:
        """`tenant`'s share of the limit: divided evenly among those holding places and it."""
        holding = {t for t, n in self.held.items() if n > 0} | {tenant}
        return self.limit / len(holding)

    def hold(self, tenant: str, count: int) -> QueuedCall:
        call = QueuedCall(tenant, count)
        self.held[tenant] += count
        self.calls.append(call)
        return call

    def release(self, call: QueuedCall) -> None:
        """The call started (its first output) or ended; idempotent."""
        if call.released:
            return
        call.released = True
        self.held[call.tenant] -= call.count
        if self.held[call.tenant] <= 0:
            del self.held[call.tenant]
        self.calls.remove(call)

    def displaceable(
        self, tenant: str, count: int, need: int, waiting: Callable[[str], bool]
    ) -> list[QueuedCall] | None:
        """Calls whose places make `need` places for `count` requests of `tenant`: the youngest
        still in preparation (tokenizing, compiling: no ids yet) or wholly `waiting` (submitted,
        never run), of tenants that stay over their share before each is taken. None where
        `tenant` itself would be over its share, or too few can go."""
        share = self.share(tenant)
        if self.held[tenant] + count > share:
            return None
        held, out, freed = Counter(self.held), [], 0
        for call in reversed(self.calls):
            if freed >= need:
                break
            if call.tenant == tenant or call.displaced or held[call.tenant] <= share:
                continue
            if all(waiting(rid) for rid in call.request_ids):  # none yet: still in preparation
                out.append(call)
                held[call.tenant] -= call.count
                freed += call.count
        return out if freed >= need else None
