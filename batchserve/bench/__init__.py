"""`batchserve bench`: measure batchserve's drafters against HF peers, or simulate them without the model."""

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
