"""The model side of a step: packing its ragged batch, one forward, verification (loading is
`batchserve.model.loader`'s, re-exported here)."""

from batchserve.model.loader import load_model, load_tokenizer, resolve_model_path
from batchserve.runner.runner import ModelRunner

__all__ = ["ModelRunner", "load_model", "load_tokenizer", "resolve_model_path"]
