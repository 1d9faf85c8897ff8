"""How a llama.cpp peer that died is told and reported: its exit read, the failure that ends it.

On some CPUs llama.cpp's own kernels crash the process running them: a VM on a Sapphire Rapids
Xeon lists AMX in cpuid but its kernel does not grant the tile state, so llama.cpp's AMX kernels
die with SIGILL at their first tile instruction. Both llama.cpp peers run in a process of their
own (llama-cpp-python in a child, `llama-server` as itself), so a crash ends that process, not
the bench; each is then rerun once on llama.cpp's other kernels, and the report says so.
"""

from __future__ import annotations

import signal

from batchserve.bench.methods import Row


class PeerFailed(RuntimeError):
    """A peer could not give its run, on either set of llama.cpp's kernels: the bench reports
    the reason and goes on with its other rows."""


def signal_name(code: int) -> str:
    """The signal a negative return code names: `SIGILL` for -4."""
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def exit_reason(code: int | None) -> str:
    """What a process's return code says, as a report reads it: `crashed (SIGILL)` for a signal
    (a negative code), `exited with status 3` otherwise."""
    if code is None:
        return "did not exit"
    return f"crashed ({signal_name(code)})" if code < 0 else f"exited with status {code}"


def peer_notes(rows: list[Row], failures: list[str]) -> list[str]:
    """The report's lines on peers that ran on llama.cpp's fallback kernels (a row's `note`, once
    per dataset and method) and on those that failed both ways (`failures`, each once)."""
    notes = dict.fromkeys(f"`{r.method}` on {r.dataset}: {r.note}." for r in rows if r.note)
    return [*notes, *dict.fromkeys(failures)]
