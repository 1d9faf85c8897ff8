"""The loop that serves: one EngineCore's step phases in the order `AsyncEngine` runs them, a
step's outputs built beside the next forward where a device leaves the host free.

A step is schedule -> launch -> collect -> advance -> finish (`EngineCore`, records in
`pipeline.py`). `advance` applies what the next schedule needs; `finish` builds the outputs, which
nothing in the next schedule reads, so `finish` of step N may run while step N+1's forward does,
and the outputs are the same as the sequential loop's (`EngineCore.step`). `LLM` and the
benchmarks run this loop as it is; `AsyncEngine` runs its launch and collect in its step thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from batchserve.pipeline import AdvancedStep, PendingStep
from batchserve.request import RequestOutput

logger = logging.getLogger("batchserve")


class SteppingCore(Protocol):
    """What the loop that serves drives: an EngineCore's step phases."""

    def has_work(self) -> bool: ...
    def outputs_where(self, beside_forward: bool) -> None: ...
    def schedule(self) -> PendingStep: ...
    def launch(self, step: PendingStep) -> None: ...
    def learn(self) -> None: ...
    def collect(self, step: PendingStep) -> None: ...
    def advance(self, step: PendingStep) -> AdvancedStep: ...
    def finish(self, advanced: AdvancedStep) -> list[RequestOutput]: ...
    def abort(self, request_id: str) -> RequestOutput | None: ...


class StepPipeline:
    """The loop that serves, over one EngineCore: each `step()` schedules and launches step N,
    then, while N's forward runs, builds step N-1's outputs (`beside_forward`) and lets the
    drafter learn, then collects and advances N. `AsyncEngine` runs the same phases in the same
    order, launch and collect in its step thread (`between` and `after` are its share).

    `beside_forward` (a device whose forward leaves the host free): `step()` returns N-1's
    outputs (the last step's come from `flush`, or the next call once there is no work). Without
    it (a CPU, whose forward takes the host's cores): N's own, built after it is advanced."""

    def __init__(
        self,
        core: SteppingCore,
        beside_forward: bool = True,
        failed: Callable[[Exception], list[RequestOutput]] | None = None,
    ) -> None:
        """`failed`: what ends every request after a bug outside them (`after`, `flush`); None:
        the bug raises to the caller."""
        self.core = core
        self._beside_forward = beside_forward
        core.outputs_where(beside_forward)
        self._advanced: AdvancedStep | None = None  # the step whose outputs are still to build
        self.failed = failed

    @property
    def beside_forward(self) -> bool:
        return self._beside_forward

    @beside_forward.setter
    def beside_forward(self, beside: bool) -> None:
        self._beside_forward = beside
        self.core.outputs_where(beside)

    def has_work(self) -> bool:
        return self.core.has_work() or self._advanced is not None

    def step(self) -> list[RequestOutput]:
        core = self.core
        if not core.has_work():
            return self.flush()
        step = core.schedule()
        core.launch(step)
        outputs = self.between()
        core.collect(step)
        return outputs + self.after(step)

    def between(self) -> list[RequestOutput]:
        """The host's work while a launched forward runs: the last step's outputs where they are
        built beside it, and what the drafter learns from the last commit."""
        outputs = self.flush() if self.beside_forward else []
        self.core.learn()
        return outputs

    def after(self, step: PendingStep) -> list[RequestOutput]:
        """Advance a collected step; its outputs now, unless they wait for the next forward. A
        bug in `advance` (outside any one request) ends every request through `failed` (the
        engine's `fail_all`, counted as a failed step) rather than leave a stream waiting."""
        try:
            self._advanced = self.core.advance(step)
        except Exception as e:
            if self.failed is None:
                raise
            logger.exception("engine loop error")
            return self.failed(e)
        return [] if self.beside_forward else self.flush()

    def flush(self) -> list[RequestOutput]:
        """The outputs of the step advanced last, built now (none if they were). A bug building
        them ends every request through `failed`, as in `after`."""
        advanced, self._advanced = self._advanced, None
        if advanced is None:
            return []
        try:
            return self.core.finish(advanced)
        except Exception as e:
            if self.failed is None:
                raise
            logger.exception("building a step's outputs failed")
            return self.failed(e)

    def abort(self, request_id: str) -> list[RequestOutput]:
        """Cancel a request: the outputs still owed (the last step's), then its final one."""
        outputs = self.flush()
        final = self.core.abort(request_id)
        return outputs + ([final] if final is not None else [])
