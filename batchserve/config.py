"""Frozen configuration dataclasses, one per concern, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DraftMethod = Literal["none", "llma"]
DRAFT_METHODS: tuple[str, ...] = ("none", "llma")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to load and how."""

    path: str | None = None  # local HF directory or .gguf file; None = SmolLM2-135M-Instruct
    dtype: str = "float32"
    device: str = "cpu"
    max_model_len: int | None = None  # None = the model's max_position_embeddings

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV pool: `num_blocks` pages of `block_size` token slots each."""

    block_size: int = 16
    num_blocks: int | None = None  # None = derive from `kv_cache_memory_gb`
    kv_cache_memory_gb: float = 1.0

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 16  # running requests at once: the batch size users tune
    max_num_batched_tokens: int = 512  # tokens per forward: prompt chunks + roots + drafts

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                "max_num_batched_tokens must be >= max_num_seqs (every running request "
                f"needs one token per step), got {self.max_num_batched_tokens} < {self.max_num_seqs}"
            )


@dataclass(frozen=True, slots=True)
class DraftConfig:
    """Speculation: which drafter proposes trees and how many tokens each may hold."""

    method: DraftMethod = "llma"
    decoding_length: int = 16  # draft tokens per request per step (tree nodes, root excluded)
    max_match: int = 8  # LLMA: longest suffix tried when looking for a copy source
    min_match: int = 1  # LLMA: shortest suffix accepted as a match

    def __post_init__(self) -> None:
        if self.method not in DRAFT_METHODS:
            raise ValueError(f"draft method must be one of {DRAFT_METHODS}, got {self.method!r}")
        if self.decoding_length < 0:
            raise ValueError(f"decoding_length must be >= 0, got {self.decoding_length}")
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {self.min_match} and {self.max_match}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs, grouped by concern."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    draft: DraftConfig = DraftConfig()
