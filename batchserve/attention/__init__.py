"""Attention backends over the paged KV pool."""

from batchserve.attention.base import AttentionBackend, SeqLayout, slots_of
from batchserve.attention.torch_ref import TorchReferenceBackend

__all__ = ["AttentionBackend", "SeqLayout", "TorchReferenceBackend", "slots_of"]
