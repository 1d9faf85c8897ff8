"""batchserve: continuously batched LLM serving with lossless lookahead (trie) drafts."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from batchserve.request import FinishReason, RequestOutput, SamplingParams

if TYPE_CHECKING:
    from batchserve.admission import Submission
    from batchserve.async_engine import AsyncEngine
    from batchserve.engine import EngineCore
    from batchserve.llm import LLM

__all__ = ["LLM", "AsyncEngine", "EngineCore", "FinishReason", "RequestOutput", "SamplingParams", "Submission"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The engine pulls in torch and transformers; import it only when asked for, so the
    # pure-Python layers (scheduler, drafts) stay light to import.
    modules = {
        "LLM": "batchserve.llm",
        "AsyncEngine": "batchserve.async_engine",
        "EngineCore": "batchserve.engine",
        "Submission": "batchserve.admission",
    }
    if name in modules:
        import importlib

        return getattr(importlib.import_module(modules[name]), name)
    raise AttributeError(f"module 'batchserve' has no attribute {name!r}")
