"""Build the model side of an engine: size the KV pool, pick the attention backend, wrap the runner."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from batchserve.attention import INVARIANT_BACKENDS, AttentionBackend, make_backend, resolve_backend
from batchserve.config import EngineConfig
from batchserve.model import uses_our_kernels
from batchserve.runner.graphs import CaptureReport, StepGraphs
from batchserve.runner.runner import ModelRunner
from batchserve.runner.self_check import CheckResult, check_invariance

logger = logging.getLogger("batchserve")


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the rest of the engine needs to know about the loaded model."""

    vocab_size: int
    max_model_len: int
    num_blocks: int  # KV blocks in the pool the scheduler allocates from
    probe_block: int  # one more block, outside that pool: scratch K/V for the device probe
    attention_backend: str  # the resolved backend: "kernel", "invariant" or "torch" on CPU, "flashinfer" on CUDA
    eos_token_ids: frozenset[int]
    graphs: str = "off"  # the resolved cuda_graphs mode: on (captured), eager or off
    capture: CaptureReport | None = None  # what capturing the graphs took (mode `on`)
    # The start-up check of the contract on this model (`self_check`): None where none is claimed
    # (no invariant attention: the torch reference, or a GPU).
    check: CheckResult | None = None

    @property
    def batch_invariant(self) -> bool:
        """Whether a request's logits were found bit for bit the same alone and in a batch."""
        return self.check is not None and self.check.invariant


def build_checked_runner(model: Any, tokenizer: Any, config: EngineConfig) -> tuple[ModelRunner, ModelFacts]:
    """`build_runner`, then the contract checked on the real model where the invariant attention
    claims it. A failed comparison says so and falls back to the torch reference attention, as
    `auto` does where the kernel checks fail; a pool too small to check keeps the backend."""
    runner, facts = build_runner(model, tokenizer, config)
    if facts.attention_backend not in INVARIANT_BACKENDS:
        return runner, facts
    check = check_invariance(runner, facts.num_blocks)
    failed = check.rows > 0 and not check.invariant
    if check.invariant:
        logger.info(
            "batch invariance: checked on the model, %d rows bit for bit the same (%.2f s)", check.rows, check.seconds
        )
    elif failed:
        logger.warning(
            "batch invariance: FAILED on the model at %d threads (%s): falling back to the torch attention; a request's"
            " logits may depend on its batch",
            torch.get_num_threads(),
            check.detail,
        )
        del runner
        fallback = dataclasses.replace(config, model=dataclasses.replace(config.model, attention_backend="torch"))
        runner, facts = build_runner(model, tokenizer, fallback)
    else:
        logger.warning("batch invariance: %s", check.detail)
    return runner, dataclasses.replace(facts, check=check)


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
    max_model_len = config.model.max_model_len or mc.max_position_embeddings
    backend = make_backend(
        backend_name,
        num_layers=mc.num_hidden_layers,
        # Two blocks past the scheduler's pool: the device probe's (EngineCore.device_works) and the
        # scratch block that padding rows of bucketed steps write to.
        num_blocks=num_blocks + 2,
        block_size=config.cache.block_size,
        num_qo_heads=mc.num_attention_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=param.dtype,
        device=param.device,
        sm_scale=attention_scale(model),
        max_model_len=max_model_len,
    )
    mode, graphs = step_graphs(model, backend, config, scratch_block=num_blocks + 1)
    runner = ModelRunner(model, backend, config.model.cpu_linear, graphs)
    capture = capture_graphs(graphs) if mode == "on" and graphs is not None else None
    facts = ModelFacts(
        vocab_size=mc.vocab_size,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        probe_block=num_blocks,
        attention_backend=backend_name,
        eos_token_ids=eos_token_ids(model, tokenizer),
        graphs=mode,
        capture=capture,
    )
    return runner, facts


def step_graphs(model: Any, backend: Any, config: EngineConfig, scratch_block: int) -> tuple[str, StepGraphs | None]:
    """The resolved cuda_graphs mode and, unless off, the bucketed steps' buffers."""
    param = next(model.parameters())
    mode = graphs_mode(config.model.cuda_graphs, param.device, getattr(model, "native", False), backend)
    if mode == "off":
        return mode, None
    sc = config.scheduler
    rows = graph_rows(sc.max_num_seqs, sc.max_num_batched_tokens, config)
    return mode, StepGraphs.for_settings(model, backend, scratch_block, rows, sc.max_num_seqs)


def capture_graphs(graphs: StepGraphs) -> CaptureReport:
    logger.info("capturing CUDA graphs for %d step buckets", len(graphs.all_buckets()))
    report = graphs.capture()
    mib = report.bytes / 2**20
    logger.info("CUDA graphs: %d captured in %.1f s, %.0f MiB of device memory", report.graphs, report.seconds, mib)
    return report


def graphs_mode(setting: str, device: torch.device, native: bool, backend: AttentionBackend) -> str:
    """`on`, `eager` or `off` for the cuda_graphs setting: auto is on for the native model on CUDA
    (the forward whose Python makes no data-dependent decision) over a backend that declares its
    kernels safe to replay (`graph_safe`), off elsewhere. `on` where no graph can be captured, or
    replayed correctly, is an error; `eager` runs the bucketed steps on any backend."""
    why_not = graphs_refused(device, native, backend)
    if setting == "auto":
        return "off" if why_not else "on"
    if setting == "on" and why_not:
        raise ValueError(f"cuda_graphs=on: {why_not} (eager runs the same bucketed steps without capture)")
    return setting


def graphs_refused(device: torch.device, native: bool, backend: AttentionBackend) -> str | None:
    """Why no CUDA graph may be captured here; None where one may."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, the model is on {device}"
    if not native:
        return "CUDA graphs need the native model (model_impl native or auto)"
    if not backend.graph_safe:
        return (
            f"the {type(backend).__name__} attention builds its metadata afresh each step, so a captured graph"
            " would replay the capture's layout"
        )
    return None


def graph_rows(max_num_seqs: int, max_num_batched_tokens: int, config: EngineConfig) -> int:
    """The most rows a step without a prompt chunk can have: every seat's root, draft and window
    rows, within the step's token budget (a larger step runs eagerly)."""
    d = config.draft
    per_request = 1 + (d.decoding_length if d.method != "none" else 0)
    if d.method in ("jacobi", "hybrid"):  # the window's rows and the pooled n-grams' nodes
        per_request += (d.ngram_size - 1) * (d.window_size + d.guesses)
    return max(1, min(max_num_batched_tokens, max_num_seqs * per_request))


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
    kernels = " on our kernels" if uses_our_kernels(model) else ""
    return f"native {getattr(model, 'cpu_weights', '-')} weights{kernels}, {attention_backend} attention"
