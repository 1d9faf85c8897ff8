"""The proof that the `hf-static` peer ran compiled; without it, its row fails.

`hf-static` is HF `generate` at its fastest: a static cache and a compiled forward (CUDA graphs
on a GPU). Run eager, it decodes about 10x slower on a GPU, and every "x over hf-static" would read
about 10x too high. So its run carries `CompileStats`, and `check_compiled` asks of them: every
timed decode step called transformers' compiled forward; dynamo compiled it (in this run or an
earlier one on the same model) and never gave up on it (past its recompile limit it would run the
frame eager, silently: `watch_compiles` makes that an error); and, where a limit is set (CUDA), the
decode stays under it. A run that fails any raises `PeerNotCompiled`, which the sweep reports as the
row's failure.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from batchserve.bench.crashes import PeerFailed

# hf-static's decode limit on CUDA, ms per token, for the default model (SmolLM2-135M, batch 1):
# compiled and replayed as a CUDA graph, transformers decodes it on an H100 in well under 10 ms a
# token (a step is launch-bound; the graph launches all its kernels at once); eager it runs about
# 10x slower. A larger model may need a larger limit (`sweep.run(hf_static_max_ms=...)`).
HF_STATIC_MAX_MS_CUDA = 10.0


@dataclass(frozen=True, slots=True)
class StaticPeer:
    """How a sweep runs hf-static: `repeats` times (its row the kept run), each failing above
    `max_ms` decode ms a token (None: `decode_limit_ms`'s default for the device; math.inf: none)."""

    repeats: int = 1
    max_ms: float | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1 or (self.max_ms is not None and not self.max_ms > 0):
            raise ValueError(f"hf-static runs at least once, under a positive limit: got {self}")


HF_STATIC = StaticPeer()  # one run, the device's limit


class PeerNotCompiled(PeerFailed):
    """`hf-static` asked for a compiled forward and its run does not prove one ran (or it decodes
    at eager speed): its row fails, for this reason."""


@dataclass(slots=True)
class CompileStats:
    """What torch.compile did over a static peer's warm-up and timed run."""

    graphs: int = 0  # graphs dynamo compiled (each new cache length compiles the decode step again)
    recompiles: int = 0  # compiles of a frame that already held a graph (its guards failed)
    graph_breaks: int = 0  # fullgraph=True makes one an error: 0 unless transformers lifts it (FlashAttention)
    cudagraph_records: int = 0  # CUDA graphs that cudagraph trees recorded (0 on a CPU)
    cudagraph_skips: int = 0  # graphs inductor runs without a CUDA graph (its log says why)
    timed_graphs: int = 0  # of `graphs`, compiled while timed: their compile time counts against the peer
    decode_steps: int = 0  # timed forwards after each prompt's first token: one per later token
    compiled_steps: int = 0  # timed calls to transformers' compiled forward

    def note(self) -> str:
        """One line for the log and the report."""
        return (
            f"compiled {self.graphs} graphs ({self.recompiles} recompiles, {self.timed_graphs} while timed), "
            f"{self.graph_breaks} graph breaks, {self.cudagraph_records} CUDA graphs recorded "
            f"({self.cudagraph_skips} skipped); {self.compiled_steps} compiled forwards for "
            f"{self.decode_steps} timed decode steps"
        )


def _totals() -> tuple[int, int, int]:
    """Dynamo's running counts: (graphs compiled, graph breaks, graphs run without a CUDA graph)."""
    from torch._dynamo.utils import counters

    return (
        counters["stats"]["unique_graphs"],
        sum(counters["graph_break"].values()),
        counters["inductor"]["cudagraph_skips"],
    )


@contextmanager
def watch_compiles(stats: CompileStats, timed: bool = False) -> Iterator[None]:
    """Count into `stats` what torch.compile does meanwhile (`timed`: graphs also as `timed_graphs`).
    Dynamo calls its start callbacks once per frame it compiles, with a compile id `F/N` (N > 0:
    frame F compiles again), and once per CUDA graph that cudagraph trees records. Meanwhile
    dynamo's recompile limit raises: past it, dynamo would run the forward eager, silently."""
    from torch._dynamo.callback import CallbackArgs, CallbackTrigger, callback_handler
    from torch._guards import CompileId

    def started(args: CallbackArgs) -> None:
        if args.callback_trigger is CallbackTrigger.DYNAMO:
            compile_id = CompileId.from_string(args.compile_id)
            stats.recompiles += bool(compile_id and compile_id.frame_compile_id)
        elif args.callback_trigger is CallbackTrigger.CUDAGRAPH_RECORDING:
            stats.cudagraph_records += 1

    before = _totals()
    callback_handler.register_start_callback(started)
    try:
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            yield
    finally:
        callback_handler.remove_start_callback(started)
        graphs, breaks, skips = (now - then for now, then in zip(_totals(), before))
        stats.graphs += graphs
        stats.graph_breaks += breaks
        stats.cudagraph_skips += skips
        stats.timed_graphs += graphs if timed else 0


@contextmanager
def count_compiled_calls(model: Any, stats: CompileStats) -> Iterator[None]:
    """Count into `stats.compiled_steps` the calls to transformers' compiled forward meanwhile.

    NOTE: `generate` takes its decode forward from `model.get_compiled_call`, which hands back
    `model._compiled_call` while the compile config is unchanged (it is, for a whole run). Wrapped
    here, every decode step through it counts; an eager step (`disable_compile`, or a model that
    transformers would not compile) never does. The wrapper sits outside the compiled function:
    dynamo neither traces it nor guards on it."""
    compiled = getattr(model, "_compiled_call", None)
    if compiled is None:  # transformers never compiled this model's forward
        yield
        return

    def counted(*args: Any, **kwargs: Any) -> Any:
        stats.compiled_steps += 1
        return compiled(*args, **kwargs)

    model._compiled_call = counted
    try:
        yield
    finally:
        if model.__dict__.get("_compiled_call") is counted:  # not replaced by a new compile meanwhile
            model._compiled_call = compiled


def check_compiled(
    stats: CompileStats, decode: list[tuple[int, float]] | None, max_ms: float | None, compiled_before: bool
) -> None:
    """Raise PeerNotCompiled unless `stats` prove the timed run compiled: every decode step (`decode`:
    per request, its tokens after the first and their seconds) called the compiled forward, dynamo
    compiled a graph (in this run, or `compiled_before` on this model), and the decode takes at most
    `max_ms` a token (None: no limit)."""
    tokens, seconds = sum(k for k, _ in decode or ()), sum(s for _, s in decode or ())
    stats.decode_steps = tokens
    if tokens == 0:  # one token per prompt: only the prefill ran, and it runs eager
        return
    if stats.compiled_steps < tokens:
        raise PeerNotCompiled(
            f"hf-static ran eager: {stats.compiled_steps} of its {tokens} timed decode steps"
            " called transformers' compiled forward"
        )
    if stats.graphs == 0 and not compiled_before:
        raise PeerNotCompiled("hf-static ran eager: dynamo compiled no graph of its forward")
    ms = 1000 * seconds / tokens
    if max_ms is not None and ms > max_ms:
        raise PeerNotCompiled(
            f"hf-static decodes at {ms:.1f} ms a token, over its limit of {max_ms:g} ms"
            " (a compiled forward's speed on CUDA; eager runs about 10x slower)"
        )


def decode_limit_ms(model: Any, limit: float | None = None) -> float | None:
    """hf-static's decode limit in ms a token: `limit` (math.inf: none), else `HF_STATIC_MAX_MS_CUDA`
    on CUDA and none on a CPU (inductor's CPU code has no speed we could hold it to)."""
    if limit is not None:
        return None if limit == float("inf") else limit
    return HF_STATIC_MAX_MS_CUDA if model is not None and model.device.type == "cuda" else None
