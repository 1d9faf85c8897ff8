"""Build the model side of an engine: size the KV pool, pick the attention backend, wrap the runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from batchserve.attention import make_backend, resolve_backend
from batchserve.config import EngineConfig
from batchserve.runner.runner import ModelRunner


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the rest of the engine needs to know about the loaded model."""

    vocab_size: int
    max_model_len: int
    num_blocks: int  # KV blocks in the pool the scheduler allocates from
    probe_block: int  # one more block, outside that pool: scratch K/V for the device probe
    attention_backend: str  # the resolved backend ("torch" or "flashinfer")
    eos_token_ids: frozenset[int]


def build_runner(model: Any, tokenizer: Any, config: EngineConfig) -> tuple[ModelRunner, ModelFacts]:
    """A runner over `model` with a KV pool sized by `config.cache`, and the model's facts."""
    mc = model.config
    num_kv_heads = getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // mc.num_attention_heads
    param = next(model.parameters())
    num_blocks = config.cache.num_blocks or kv_blocks_for_memory(
        config.cache.kv_cache_memory_gb,
        mc.num_hidden_layers,
        config.cache.block_size,
        num_kv_heads,
        head_dim,
        param.dtype,
    )
    from batchserve.model import has_invariant_linears

    invariant = has_invariant_linears(model)
    backend_name = resolve_backend(config.model.attention_backend, param.device, param.dtype, invariant, head_dim)
    backend = make_backend(
        backend_name,
        num_layers=mc.num_hidden_layers,
        num_blocks=num_blocks + 1,  # the last one is the probe's (EngineCore.device_works)
        block_size=config.cache.block_size,
        num_qo_heads=mc.num_attention_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=param.dtype,
        device=param.device,
        sm_scale=attention_scale(model),
    )
    facts = ModelFacts(
        vocab_size=mc.vocab_size,
        max_model_len=config.model.max_model_len or mc.max_position_embeddings,
        num_blocks=num_blocks,
        probe_block=num_blocks,
        attention_backend=backend_name,
        eos_token_ids=eos_token_ids(model, tokenizer),
    )
    return ModelRunner(model, backend, config.model.cpu_linear), facts


def kv_blocks_for_memory(
    memory_gb: float, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """How many KV blocks (K and V, every layer) fit in `memory_gb` GiB; at least one."""
    bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * (torch.finfo(dtype).bits // 8)
    return max(1, int(memory_gb * 2**30 // bytes_per_block))


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every end-of-sequence id the model's configs and the tokenizer name."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def attention_scale(model: Any) -> float | None:
    """The softmax scale the model's attention layers pass (FlashInfer plans it per step)."""
    for module in model.modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, float) and hasattr(module, "layer_idx"):
            return scaling
    return None


def forward_name(model: Any, attention_backend: str) -> str:
    """What runs a step, for logs and reports: `native q4_1 weights, invariant attention`."""
    if not getattr(model, "native", False):
        return f"transformers {next(model.parameters()).dtype}, {attention_backend} attention"
    return f"native {getattr(model, 'cpu_weights', '-')} weights, {attention_backend} attention"
