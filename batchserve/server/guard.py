"""What holds on the HTTP port before a caller is known: open connections per source address and
in all, and deadlines for a request's head and body (`SourceCounts` also caps gRPC's streams).

uvicorn's own `limit_concurrency` counts every open connection from accept, with no timer before
the first request: 500 sockets that send nothing made `/health` and every keyed call 503. Here a
connection over its source's share or the server's total is closed unread; a connection must
deliver a request's head within `head_seconds` of opening (or of its last response) and its body
within `body_seconds` of the head, or it is closed; and the call limit counts calls in the app
(`openai.door.CallLimit`), after the key check, so traffic without a key never holds a place a
keyed call needs."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("batchserve.server")


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    per_source: int = 64  # open connections one address may hold (a proxy in front: set it high)
    total: int = 4096  # open connections in all
    head_seconds: float = 10.0  # from accept, or the last response, to a request's complete head
    body_seconds: float = 30.0  # from the head to the body's last byte

    def __post_init__(self) -> None:
        if not 1 <= self.per_source <= self.total:
            raise ValueError(f"connections per source must be in [1, {self.total}], got {self.per_source}")
        if not (self.head_seconds > 0 and self.body_seconds > 0):
            raise ValueError("connection deadlines must be positive")


@dataclass(slots=True)
class SourceCounts:
    """What is open (connections, streams) by source address, at most `per_source` each and `total`
    in all; shared by the protocol instances or calls it caps."""

    per_source: int
    total: int
    by_source: Counter[str] = field(default_factory=Counter)
    open: int = 0
    refused: int = 0  # refused for a share or the total
    expired: int = 0  # closed at a deadline

    def take(self, source: str) -> bool:
        if self.open >= self.total or self.by_source[source] >= self.per_source:
            self.refused += 1
            return False
        self.by_source[source] += 1
        self.open += 1
        return True

    def give(self, source: str) -> None:
        self.open -= 1
        self.by_source[source] -= 1
        if not self.by_source[source]:
            del self.by_source[source]


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol under `connections_of` (`guarded_protocol` binds it): a connection
    over its source's share or the total is closed unread; then each request goes through three
    phases: its head (a deadline from accept or the last response), its body (a deadline from the
    head), the app's time (none). A response sent before the body is whole (a refusal, /health)
    closes the connection: the rest of the body is never read."""

    connections_of: SourceCounts
    limits_of: ConnectionLimits

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._source = self.client[0] if self.client else ""
        self._held = self.connections_of.take(self._source)
        self._timer: asyncio.TimerHandle | None = None
        self._seen: Any = None  # the request cycle whose head was last seen
        self._phase = "head"
        if not self._held:
            transport.abort()  # unread: connection_lost follows
            return
        self._arm(self.limits_of.head_seconds)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if getattr(self, "_held", False):
            self._held = False
            self.connections_of.give(self._source)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request already read
        self._track()

    def _track(self) -> None:
        """The phase the connection is in now, and its deadline."""
        cycle, limits = self.cycle, self.limits_of
        if self.transport.is_closing() or cycle is None:
            return
        if cycle is not self._seen:  # a new request's head is in: its body is due
            self._seen, self._phase = cycle, "body"
            self._arm(limits.body_seconds)
        if self._phase == "body" and cycle.response_complete and cycle.more_body:
            self.transport.close()  # answered before its body was whole: the rest is not read
        elif self._phase == "body" and not cycle.more_body:
            self._phase = "app"  # the request is whole: the app's time is its own
            self._disarm()
        if self._phase == "app" and cycle.response_complete:
            self._phase = "head"  # the next request's head is due
            self._arm(limits.head_seconds)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        timer, self._timer = getattr(self, "_timer", None), None
        if timer is not None:
            timer.cancel()

    def _expire(self) -> None:
        self._timer = None
        if not self.transport.is_closing():
            self.connections_of.expired += 1
            self.transport.abort()  # an app reading the body sees the client gone


def guarded_protocol(limits: ConnectionLimits) -> tuple[type[GuardedH11Protocol], SourceCounts]:
    """The protocol class for one server (uvicorn builds one instance a connection) and the counts
    its instances share."""
    counts = SourceCounts(limits.per_source, limits.total)
    cls = type("ServerH11Protocol", (GuardedH11Protocol,), {"connections_of": counts, "limits_of": limits})
    return cls, counts
