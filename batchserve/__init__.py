"""batchserve: continuously batched LLM serving with lossless lookahead (trie) drafts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchserve.request import FinishReason, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from batchserve.engine import LLM, AsyncEngine, EngineCore

__all__ = ["LLM", "AsyncEngine", "EngineCore", "FinishReason", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The engine pulls in torch and transformers; import it only when asked for, so the
    # pure-Python layers (scheduler, drafts) stay light to import.
    if name in ("LLM", "AsyncEngine", "EngineCore"):
        from batchserve import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'batchserve' has no attribute {name!r}")
