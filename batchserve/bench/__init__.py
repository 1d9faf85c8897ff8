"""`batchserve bench`: measure batchserve's drafters against HF peers, or simulate them without the model.

The bench is a client of the product: its runs go through `LLM`, `EngineCore` and its step
listeners, the `Client` and the `batchserve serve` process (HTTP and gRPC). Its modules import
from batchserve only the public API (`tests/bench/test_public_api.py` holds them to it):

- `batchserve`: the package's exports (`LLM`, `AsyncEngine`, `EngineCore`, `SamplingParams`,
  `RequestOutput`, `FinishReason`, `Submission`);
- `batchserve.config`: every setting; `batchserve.request`: a request's parameters, outputs and
  stats; `batchserve.records`: what `EngineCore.step_listeners` are told (`SchedulerOutput`,
  `StepPhases`); `batchserve.cost_profile`: `CostProfile`, what `batchserve calibrate` writes;
- `batchserve.server.client`: `Client`;
- `batchserve.model.loader`: what `--model` names (its file, weights and tokenizer), for peers that
  run the same model; `batchserve.model.gguf_read` and `gguf_file`: a GGUF's header and its tensors
  as mapped views, for the files the bench writes and requantizes;
- `batchserve.heap`, `batchserve.jsonl`: the process heap as `serve` settles it, JSONL reading.

Two modules reach past it, and only they: `host.py`, the engine below its public API (the
host-side stand-in: a forward that does no model work, a plan-only attention, the pipelined loop;
and the model side the public API lacks: a forward built once for many engines, the weights
`serve` picks here, the end-of-sequence ids, a cost curve on the engine's runner, a native model
of a shape), and `simulate.py`, the drafters and the adaptive policy replayed offline, which the
engine owns and exposes no handle to."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchserve.bench.methods import METHODS

if TYPE_CHECKING:
    from batchserve.bench.report import summary_table
    from batchserve.bench.sweep import run

__all__ = ["METHODS", "run", "summary_table"]


def __getattr__(name: str) -> Any:
    # The sweep and the report pull in torch; import them only when asked for, so the datasets
    # (load_tests' locustfile) and the simulation stay light to import.
    if name == "run":
        from batchserve.bench.sweep import run

        return run
    if name == "summary_table":
        from batchserve.bench.report import summary_table

        return summary_table
    raise AttributeError(f"module 'batchserve.bench' has no attribute {name!r}")
