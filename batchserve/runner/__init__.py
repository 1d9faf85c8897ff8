"""The model side: loading, packing a step's ragged batch, one forward, verification."""

from batchserve.runner.model_loader import load_model, load_tokenizer, resolve_model_path
from batchserve.runner.runner import ModelRunner

__all__ = ["ModelRunner", "load_model", "load_tokenizer", "resolve_model_path"]
