"""What the loop that serves (`serving_loop.StepPipeline`) spends a full step, from a bench run's
step listener: the host's time on the critical path, the device's, and the tokens it bought.

A full step has every seat taken. Its critical path is schedule + prepare + verify + commit, and
building the outputs too where the loop builds them after the forward (a CPU); where they are
built beside the next forward (a device), that time is hidden behind it. The device's time is
the forward phase: from the launch's end to the results back on the host (on a CPU, the forward).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from batchserve.records import SchedulerOutput, StepPhases

HOST_PHASES = ("schedule", "prepare", "verify", "commit")


@dataclass(slots=True)
class ServedSteps:
    """A step listener: per full step, host critical ms, device ms and tokens emitted."""

    batch_size: int
    beside_forward: bool  # the loop builds outputs beside the next forward
    host_ms: list[float] = field(default_factory=list)
    device_ms: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)

    def add(self, out: SchedulerOutput, phases: StepPhases) -> None:
        if len(out.requests) != self.batch_size:
            return
        host = sum(getattr(phases, n) for n in HOST_PHASES) + (0.0 if self.beside_forward else phases.outputs)
        self.host_ms.append(host * 1e3)
        self.device_ms.append(phases.forward * 1e3)
        self.tokens.append(phases.tokens)

    def summary(self) -> dict[str, Any] | None:
        """Medians over the full steps (None if none ran): `loop`, `host_ms`, `device_ms`, and
        `tokens`, the mean tokens a request emitted in a full step."""
        if not self.host_ms:
            return None
        return {
            "loop": "pipelined" if self.beside_forward else "in series",
            "steps": len(self.host_ms),
            "host_ms": round(statistics.median(self.host_ms), 3),
            "device_ms": round(statistics.median(self.device_ms), 3),
            "tokens": round(statistics.fmean(self.tokens) / self.batch_size, 3),
        }


def loop_table(rows: list[Any]) -> list[str]:
    """The report's lines on the loop that serves, for the rows that measured it."""
    timed = [r for r in rows if getattr(r, "served_step", None)]
    if not timed:
        return []
    out = [
        "\nThe loop that serves, per full step (every seat taken; medians): the host's ms on the critical "
        "path (schedule + prepare + verify + commit, and building the outputs where the loop builds them "
        "after the forward), the device's ms (the forward, to its results back on the host), and the tokens "
        "a request emitted a step:\n",
        "| method | batch | loop | full steps | host ms | device ms | tokens a step |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in timed:
        s = r.served_step
        out.append(
            f"| {r.method} | {r.batch_size} | {s['loop']} | {s['steps']} | {s['host_ms']:.2f} | "
            f"{s['device_ms']:.2f} | {s['tokens']:.2f} |"
        )
    return out
