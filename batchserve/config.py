"""Frozen configuration dataclasses, one per concern, and the one map from settings to them."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

# Re-exported: the settings machinery lives in its own module; config declares the settings.
from batchserve.draft_config import (
    ADAPTIVE_DECODING_LENGTH,
    DRAFT_LAYOUTS,
    DRAFT_METHODS,
    FIXED_DECODING_LENGTH,
    TRIE_SCOPES,
    DraftConfig,
    DraftLayout,
    DraftMethod,
)
from batchserve.settings import Setting, check_choice, setting, settings_of

# Re-exported too: speculation's settings live in draft_config.py, one concern to a module.
__all__ = [
    "DRAFT_LAYOUTS",
    "DRAFT_METHODS",
    "SETTINGS",
    "TRIE_SCOPES",
    "DraftConfig",
    "DraftLayout",
    "DraftMethod",
    "EngineConfig",
    "Setting",
    "setting",
    "settings_of",
]

MODEL_DTYPES: tuple[str, ...] = ("auto", "float32", "float16", "bfloat16")
MODEL_IMPLS: tuple[str, ...] = ("auto", "native", "transformers")  # batchserve.model.choose_impl
CPU_WEIGHTS: tuple[str, ...] = ("auto", "gguf", "float32", "bfloat16")  # batchserve.model.choose_impl
# Choices that were removed -> what to ask for instead (a config naming one fails saying so).
RETIRED_CPU_WEIGHTS = {
    "q4_1": "a GGUF file's Q4_1 blocks (and every other type's) are read straight from the file with cpu_weights=gguf,"
    " which auto takes wherever our kernels run",
}
ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "flashinfer", "kernel", "invariant", "torch")  # resolve_backend's
CPU_LINEAR: tuple[str, ...] = ("auto", "torch", "onednn")  # batchserve.runner.cpu_linear's
CUDA_GRAPHS: tuple[str, ...] = ("auto", "on", "off", "eager")  # batchserve.runner.forward.graphs_choice
CUDA_GRAPHS_HELP = (
    "on: steps without a prompt chunk replay CUDA graphs captured at start-up per row and request bucket; auto: on for"
    " the native model on CUDA over a backend safe to replay (flashinfer); eager: the same steps uncaptured; off: none"
)
THREADS_HELP = "torch threads (serve: $BATCHSERVE_NUM_THREADS, else the CPUs it may use: affinity, cgroup quota)"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Which model to load and how."""

    path: str | None = setting(None, "HF model directory or .gguf file (default: SmolLM2-135M-Instruct)", name="model")
    dtype: str = setting("auto", "auto: bfloat16 on CUDA, float32 on CPU", choices=MODEL_DTYPES)
    device: str = setting("auto", "cpu, cuda or cuda:N (auto: cuda when available)")
    max_model_len: int | None = setting(None, "context length (default: the model's max_position_embeddings)")
    attention_backend: str = setting(
        "auto",
        "auto: FlashInfer on CUDA in fp16/bf16 when installed; on CPU for the native model our kernel (kernel) where"
        " it builds, else the batch-invariant torch-op one (invariant) where this CPU passes its check; else torch",
        choices=ATTENTION_BACKENDS,
    )
    model_impl: str = setting(
        "auto",
        "the forward: native (batchserve.model, Llama family), transformers, or auto (see choose_impl)",
        choices=MODEL_IMPLS,
    )
    # oneDNN's kernel makes multi-row steps (drafts) much cheaper on CPU; with rows padded to a
    # few buckets its memory stays bounded (a 10-minute soak: +2.2%; see runner/cpu_linear.py).
    cpu_linear: str = setting(
        "auto",
        "CPU products: oneDNN's float32 and bfloat16 kernels and ours over a GGUF file's blocks (auto: where they"
        " run) or torch's own (a GGUF file then loads through transformers)",
        choices=CPU_LINEAR,
    )
    cpu_weights: str = setting(
        "auto",
        "native model on CPU: gguf: a GGUF file read straight from its blocks, each tensor at its own type (Q4_0,"
        " Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, Q2_K-Q6_K, IQ4_XS) on our kernels, memory-mapped, no float32 copy (a type"
        " without a kernel of ours runs as bfloat16, named at start-up); float32; bfloat16: bfloat16 copies of the"
        " products' weights on our kernels (an HF directory is read tensor by tensor). auto: gguf for a GGUF file"
        " where our kernels build; else bfloat16 where it runs fast (AVX-512), else float32 (the log says which, why)",
        choices=CPU_WEIGHTS,
    )
    num_threads: int | None = setting(None, THREADS_HELP)
    cuda_graphs: str = setting("auto", CUDA_GRAPHS_HELP, choices=CUDA_GRAPHS)

    def __post_init__(self) -> None:
        check_choice("cuda_graphs", self.cuda_graphs, CUDA_GRAPHS)
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        check_choice("dtype", self.dtype, MODEL_DTYPES)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_choice("cpu_linear", self.cpu_linear, CPU_LINEAR)
        check_choice("model_impl", self.model_impl, MODEL_IMPLS)
        if self.cpu_weights in RETIRED_CPU_WEIGHTS:
            retired = RETIRED_CPU_WEIGHTS[self.cpu_weights]
            raise ValueError(f"cpu_weights={self.cpu_weights} is no longer a choice: {retired}; one of {CPU_WEIGHTS}")
        check_choice("cpu_weights", self.cpu_weights, CPU_WEIGHTS)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """The paged KV pool: `num_blocks` pages of `block_size` token slots each."""

    block_size: int = setting(16, "KV slots per block")
    num_blocks: int | None = setting(None, "KV blocks in the pool (default: as many as kv_cache_memory_gb holds)")
    kv_cache_memory_gb: float = setting(1.0, "KV cache size in GiB", flags=("--kv-cache-gb",))
    # Requests share cached blocks only within their trie scope (DraftConfig.trie_scope), so a
    # prefix's time to first token cannot tell one tenant what another sent.
    prefix_caching: bool = setting(True, "reuse the KV blocks of prompt prefixes already computed (within a scope)")

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

    max_num_seqs: int = setting(16, "running requests at once: the batch size", flags=("--max-batch-size",))
    max_num_batched_tokens: int = setting(
        512, "tokens per forward: prompt chunks, roots and drafts", flags=("--max-tokens-per-step",)
    )
    # A policy, not a device figure: the measured step time is what it bounds (scheduler/fairness.py).
    tenant_slack: float = setting(
        0.1, "how much longer a tenant's prompts over a step's budget may make a step serving other tenants"
    )
    prompt_stall: float = setting(
        1.0, "how much longer prompt chunks may make a step that carries decodes (measured; inf: no bound)"
    )

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                "max_num_batched_tokens must be >= max_num_seqs (every running request "
                f"needs one token per step), got {self.max_num_batched_tokens} < {self.max_num_seqs}"
            )
        if not 0 <= self.tenant_slack <= 1000:
            raise ValueError(f"tenant_slack must be in [0, 1000], got {self.tenant_slack}")
        if not self.prompt_stall > 0:  # NaN too; inf: no bound
            raise ValueError(f"prompt_stall must be positive (inf: no bound), got {self.prompt_stall}")


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    """Bounds on what one request may ask for; every front end gets them from the engine."""

    max_stop_sequences: int = setting(16, "stop strings per request")
    max_stop_length: int = setting(256, "characters per stop string")
    max_request_id_length: int = setting(128, "characters of a request id or tenant key ([A-Za-z0-9._:-])")
    max_prompt_chars_per_token: int = setting(32, "text longer than this times the context is refused untokenized")
    # Each emitted token is looked up in a set of them; the count bounds the request's size on the loop.
    max_stop_token_ids: int = setting(64, "stop token ids per request")
    # A chat template renders every message (even an empty one): bound them before templating.
    max_chat_messages: int = setting(1024, "chat messages per request")
    # Each is searched every step the request drafts; their tokens together are bounded by the context.
    max_references: int = setting(16, "reference texts (predicted outputs) per request")
    # Compiled off the event loop and cached by text; llguidance bounds the grammar's size and the
    # work per token on top of this (its LLParserLimits defaults).
    max_constraint_chars: int = setting(65536, "characters of a JSON schema, regex or grammar")
    max_samples: int = setting(8, "completions of one request (OpenAI's n and best_of), sharing its prompt's KV")

    def __post_init__(self) -> None:
        for s in settings_of(LimitsConfig):
            if getattr(self, s.field) < 1:
                raise ValueError(f"{s.field} must be >= 1, got {getattr(self, s.field)}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine needs, grouped by concern."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    draft: DraftConfig = DraftConfig()
    limits: LimitsConfig = LimitsConfig()

    def with_settings(self, **settings: Any) -> EngineConfig:
        """This config with the named settings changed (see `SETTINGS`); unknown names raise TypeError.

        >>> EngineConfig().with_settings(draft="none", max_num_seqs=4).scheduler.max_num_seqs
        4
        """
        unknown = sorted(set(settings) - set(SETTINGS))
        if unknown:
            raise TypeError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(SETTINGS)}")
        by_section: dict[str, dict[str, Any]] = {}
        for name, value in settings.items():
            s = SETTINGS[name]
            by_section.setdefault(s.section, {})[s.field] = value
        sections = {}
        for section, changes in by_section.items():
            current = getattr(self, section)
            if section == "draft" and "adaptive" in changes and "decoding_length" not in changes:
                # The length default follows the policy unless it was set on its own.
                default = ADAPTIVE_DECODING_LENGTH if current.adaptive else FIXED_DECODING_LENGTH
                changes["decoding_length"] = None if current.decoding_length == default else current.decoding_length
            sections[section] = dataclasses.replace(current, **changes)
        return dataclasses.replace(self, **sections)


# Every setting of the engine by name: LLM's keywords, the CLI's flags.
SETTINGS: dict[str, Setting] = {
    s.name: s for f in dataclasses.fields(EngineConfig) for s in settings_of(type(f.default), f.name)
}
