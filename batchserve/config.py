"""Frozen configuration dataclasses, one per concern, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

DraftMethod = Literal["none", "llma", "lookahead"]
DRAFT_METHODS: tuple[str, ...] = ("none", "llma", "lookahead")
TRIE_SCOPES: tuple[str, ...] = ("global", "tenant", "request")
DraftLayout = Literal["hierarchical", "parallel", "single"]
DRAFT_LAYOUTS: tuple[str, ...] = ("hierarchical", "parallel", "single")
MODEL_DTYPES: tuple[str, ...] = ("auto", "float32", "float16", "bfloat16")
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "flashinfer", "torch")  # batchserve.attention's, kept torch-free here
CPU_LINEAR: tuple[str, ...] = ("torch", "onednn")  # batchserve.runner.cpu_linear's


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to load and how."""

    path: str | None = None  # local HF directory or .gguf file; None = SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto = bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # auto = cuda when available, else cpu
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    attention_backend: str = "auto"  # auto = flashinfer on CUDA (fp16/bf16) when installed, else torch
    # float32 on CPU: torch's own matmuls, or oneDNN's linear kernel (faster for multi-row steps, but its
    # memory grows with the number of step shapes seen: opt-in until that is bounded)
    cpu_linear: str = "torch"

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")
        if self.cpu_linear not in CPU_LINEAR:
            raise ValueError(f"cpu_linear must be one of {CPU_LINEAR}, got {self.cpu_linear!r}")
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
    """Speculation: which drafter proposes trees, their shape and how many tokens they hold.

    `lookahead` is the trie of prompt and output n-grams (the Lookahead paper); `llma` copies
    a single branch from the request's own text; `none` decodes plainly.
    """

    method: DraftMethod = "lookahead"
    decoding_length: int = 16  # draft tokens per request per step (root excluded); the cap when adaptive
    adaptive: bool = False  # choose each request's length every step from the cost profile and acceptance
    profile_path: str | None = None  # adaptive: cost profile JSON; None = the per-device cache (calibrate if absent)
    acceptance_decay: float = 0.3  # adaptive: weight of the newest verification in the acceptance EMA
    explore: float = 0.05  # adaptive: per idle step, how far a request's estimates drift back to the pool's
    min_gain: float = 0.02  # adaptive: never draft a node accepted less often than this
    learn_step_costs: bool = True  # adaptive: refine the profile from measured steps (off: trust it as is)
    layout: DraftLayout = "hierarchical"  # lookahead: prefix-merged tree, disjoint chains, or one chain
    branch_length: int = 12  # lookahead: n-gram length inserted into the trie
    max_match: int = 4  # longest suffix of the request's tokens tried as a match key
    min_match: int = 1  # shortest suffix accepted as a match key
    prompt_weight: float = 100.0  # lookahead: a request's own prompt/output n-gram counts this much more
    trie_capacity: int = 200_000  # lookahead: output-trie nodes before decay-and-prune
    warmup_path: str | None = None  # lookahead: JSONL of earlier outputs ({"text"} or {"token_ids"})
    warmup_scope: str = ""  # lookahead: the scope (tenant key) the warm-up corpus is loaded into
    # lookahead: who shares output n-grams. global: every request; tenant: requests with the same
    # tenant key ("" for requests without one); request: each request drafts from its own text only.
    trie_scope: str = "tenant"

    def __post_init__(self) -> None:
        if self.method not in DRAFT_METHODS:
            raise ValueError(f"draft method must be one of {DRAFT_METHODS}, got {self.method!r}")
        if self.layout not in DRAFT_LAYOUTS:
            raise ValueError(f"draft layout must be one of {DRAFT_LAYOUTS}, got {self.layout!r}")
        if self.decoding_length < 0:
            raise ValueError(f"decoding_length must be >= 0, got {self.decoding_length}")
        if self.branch_length < 2:
            raise ValueError(f"branch_length must be >= 2, got {self.branch_length}")
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError(f"need 1 <= min_match <= max_match, got {self.min_match} and {self.max_match}")
        if self.prompt_weight <= 0:
            raise ValueError(f"prompt_weight must be > 0, got {self.prompt_weight}")
        if not 0 < self.acceptance_decay <= 1:
            raise ValueError(f"acceptance_decay must be in (0, 1], got {self.acceptance_decay}")
        if not 0 <= self.explore <= 1:
            raise ValueError(f"explore must be in [0, 1], got {self.explore}")
        if not 0 <= self.min_gain < 1:
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if self.trie_scope not in TRIE_SCOPES:
            raise ValueError(f"trie_scope must be one of {TRIE_SCOPES}, got {self.trie_scope!r}")
        if self.trie_capacity < 1:
            raise ValueError(f"trie_capacity must be >= 1, got {self.trie_capacity}")


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Bounds on what one request may ask for; every front end gets them from the engine."""

    max_stop_sequences: int = 16  # stop strings per request
    max_stop_length: int = 256  # characters per stop string
    max_request_id_length: int = 128  # characters of [A-Za-z0-9._:-]
    max_prompt_chars_per_token: int = 32  # text longer than this x the context is refused untokenized

    def __post_init__(self) -> None:
        for name in ("max_stop_sequences", "max_stop_length", "max_request_id_length", "max_prompt_chars_per_token"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs, grouped by concern."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    draft: DraftConfig = DraftConfig()
    limits: LimitsConfig = LimitsConfig()
