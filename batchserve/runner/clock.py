"""The runner's phase clock: the time between two marks charged to a named phase of the step,
so that the step's code reads as its steps and its timing stays beside them."""

from __future__ import annotations

import time


class PhaseClock:
    """Charges the time since the last mark to a phase; a phase may be charged in several pieces
    (the host work between a launch and its result is `prepare`, though it follows `forward`'s)."""

    __slots__ = ("_last", "spent")

    def __init__(self) -> None:
        self._last = time.perf_counter()
        self.spent: dict[str, float] = {"prepare": 0.0, "forward": 0.0, "verify": 0.0, "grammar": 0.0}

    def charge(self, phase: str, until: float | None = None) -> None:
        """The time from the last mark to now (or to `until`, a `perf_counter` reading) is `phase`'s."""
        now = time.perf_counter() if until is None else until
        self.spent[phase] += now - self._last
        self._last = now
