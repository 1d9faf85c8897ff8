"""Build the model side of an engine from its `ForwardChoice`: size the KV pool, make the attention
backend, capture the step graphs, wrap the runner; check the batch-invariance contract on the model."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from batchserve.attention import INVARIANT_BACKENDS, make_backend
from batchserve.config import EngineConfig
from batchserve.model import has_invariant_linears
from batchserve.model.llama import attention_sinks, layer_attention, rope_limit
from batchserve.runner.check_cache import (
    cached_check,
    check_key,
    memo_key,
    remember_check,
    remembered_check,
    shape_key,
    store_check,
)
from batchserve.runner.forward import ForwardChoice
from batchserve.runner.graphs import CaptureReport, StepGraphs
from batchserve.runner.layer_check import check_layers
from batchserve.runner.runner import ModelRunner
from batchserve.runner.self_check import CheckResult, check_invariance

logger = logging.getLogger("batchserve")


class StartupCheckFailed(ValueError):
    """The start-up check found NaN or Inf, or a claimed batch invariance that does not hold: the
    engine is not built, and the message names the layer (or rows) and the file's fallback tensors."""


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the rest of the engine needs to know about the loaded model."""

    vocab_size: int
    max_model_len: int
    num_blocks: int  # KV blocks in the pool the scheduler allocates from
    probe_block: int  # one more block, outside that pool: scratch K/V for the device probe
    forward: ForwardChoice  # what runs every step, and why (after any fallback)
    eos_token_ids: frozenset[int]
    capture: CaptureReport | None = None  # what capturing the graphs took (mode `on`)
    # The start-up check of the contract on this model (`self_check`): None where none is claimed
    # (no invariant attention: the torch reference, or a GPU).
    check: CheckResult | None = None

    @property
    def attention_backend(self) -> str:
        """The resolved backend: "kernel", "invariant" or "torch" on CPU, "flashinfer" on CUDA."""
        return self.forward.attention.choice

    @property
    def graphs(self) -> str:
        """The resolved cuda_graphs mode: on (captured), eager or off."""
        return self.forward.graphs.choice

    @property
    def batch_invariant(self) -> bool:
        """Whether a request's logits were found bit for bit the same alone and in a batch."""
        return self.check is not None and self.check.invariant

    @property
    def invariance_why(self) -> str:
        """What the start-up check found (what was compared, or what broke), or why none ran."""
        if self.check is not None:
            return self.check.detail
        why = self.forward.attention.why
        return f"not checked: the {self.attention_backend} attention claims no batch invariance ({why})"


def build_checked_runner(
    model: Any,
    tokenizer: Any,
    config: EngineConfig,
    forward: ForwardChoice,
    cache_check: bool = False,
    source: Any = None,
) -> tuple[ModelRunner, ModelFacts]:
    """`build_runner`, then the contract checked on the native CPU model (`check_contract`) where
    the invariant attention claims it, or where auto chose no invariant attention because the
    products' probe failed (the check then names the layer). A failed check never serves: where the
    forward claims invariance, or where any output was NaN or Inf, `StartupCheckFailed` says what
    broke. Where nothing was claimed (the probe had failed) the server says `batch_invariant: false`
    with the layer to blame. `cache_check`: the engine read the model from its file
    itself, so the check's verdict may be cached by file and CPU (`check_cache`); a model handed in
    (`source`, before the forward was built over it) may be any object: its verdict is kept in this
    process for that object as it stands (`remembered_check`)."""
    runner, facts = build_runner(model, tokenizer, config, forward)
    claimed = facts.attention_backend in INVARIANT_BACKENDS
    # auto took the torch attention because the products' probe failed: check a float32 model
    # anyway (only its activations can be invariant), to name the layer to blame.
    float32 = next(model.parameters()).dtype == torch.float32
    probed = config.model.attention_backend == "auto" and facts.attention_backend == "torch" and float32
    probed = probed and not has_invariant_linears(model)
    if runner.device.type != "cpu" or not getattr(model, "native", False) or not (claimed or probed):
        return runner, facts
    key = check_key(runner, config, facts) if cache_check else None
    handed = source is not None and not cache_check
    memo = memo_key(source, forward, shape_key(runner, config, facts)) if handed else None
    check = cached_check(key) if memo is None else remembered_check(source, memo)
    if check is not None:
        refuse(model, check, claimed)
        where = "cached by file and CPU" if memo is None else "this model object's, unchanged, this process"
        logger.info("batch invariance: %s (%.2f s when checked; %s)", check.detail, check.seconds, where)
        return runner, dataclasses.replace(facts, check=check)
    check = check_contract(runner, facts, config, claimed)
    store_check(key, check)
    if memo is not None:
        remember_check(source, memo, check)
    refuse(model, check, claimed)
    if check.invariant:
        logger.info("batch invariance: %s (%.2f s)", check.detail, check.seconds)
    else:
        logger.warning(
            "batch invariance: FAILED at %d threads: %s; a request's logits may depend on its batch",
            torch.get_num_threads(),
            check.detail,
        )
    return runner, dataclasses.replace(facts, check=check)


def refuse(model: Any, check: CheckResult, claimed: bool) -> None:
    """Raise StartupCheckFailed where `check` forbids serving: any output NaN or Inf, or a claimed
    invariance that did not hold (a check that could not run, with no rows, is only reported)."""
    unchecked = check.rows == 0 and check.detail.startswith("not checked")
    if check.finite and (check.invariant or not claimed or unchecked):
        return
    what = "NaN or Inf outputs" if not check.finite else "batch invariance does not hold"
    report = getattr(model, "gguf_report", None)
    fallback = list(getattr(report, "dequantized", []) or [])
    names = f"; the file's tensors without a kernel of ours: {', '.join(fallback[:8])}" if fallback else ""
    more = f" and {len(fallback) - 8} more" if len(fallback) > 8 else ""
    raise StartupCheckFailed(
        f"the start-up check failed at {torch.get_num_threads()} threads ({what}): {check.detail}{names}{more}."
        " Not serving: a request's output would not be the model's"
    )


def check_contract(runner: ModelRunner, facts: ModelFacts, config: EngineConfig, claimed: bool) -> CheckResult:
    """Every row-wise layer at the row counts this engine calls it with (`layer_check`), then, where
    the attention claims invariance, the model's logits alone and among others (`self_check`)."""
    sc = config.scheduler
    kept = graph_rows(sc.max_num_seqs, sc.max_num_batched_tokens, config)
    layers = check_layers(runner.model, sc.max_num_batched_tokens, kept)
    if not layers.invariant:
        return CheckResult(False, 0, layers.seconds, layers.detail, layers.layers, layers.finite)
    model = check_invariance(runner, facts.num_blocks)  # unclaimed: for its finiteness
    seconds = layers.seconds + model.seconds
    if not claimed and model.finite:
        why = f"every layer passed, but the {facts.attention_backend} attention is not batch-invariant"
        return CheckResult(False, 0, seconds, why, layers.layers)
    if model.rows == 0:
        return model._replace(seconds=seconds, layers=layers.layers)
    if not model.finite:
        return model._replace(seconds=seconds, layers=layers.layers)
    if not model.invariant:
        why = f"every layer passed, but the model's logits alone and among others differ: {model.detail}"
        return CheckResult(False, model.rows, seconds, why, layers.layers)
    what = (
        f"{layers.layers} layers at up to {layers.counts} row counts each, then {model.rows} rows of the model's"
        " logits alone and among others: bit for bit the same"
    )
    return CheckResult(True, model.rows, seconds, what, layers.layers)


def context_length(mc: Any, asked: int | None) -> int:
    """The engine's context: `asked`, else the model's positions, never past where its rotary stops
    being one fixed table (`rope_limit`: LongRoPE's original context). Asking for more is refused."""
    length = int(asked or mc.max_position_embeddings)
    limit = rope_limit(mc)
    if limit is None or length <= limit:
        return length
    if asked:
        raise ValueError(
            f"max_model_len {asked} is past the model's {limit}-token original context, where LongRoPE switches"
            " factors by the longest position in a forward (batching and draft trees would change a token's"
            f" rotation, so a longer sequence would not be the model's output): at most {limit}"
        )
    logger.warning("context capped at %d tokens, LongRoPE's original context (its short factors: exact)", limit)
    return limit


def build_runner(
    model: Any, tokenizer: Any, config: EngineConfig, forward: ForwardChoice
) -> tuple[ModelRunner, ModelFacts]:
    """A runner over `model` as `forward` chose it, with a KV pool sized by `config.cache`, and the
    model's facts."""
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
    max_model_len = context_length(mc, config.model.max_model_len)
    backend = make_backend(
        forward.attention.choice,
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
        layers=layer_attention(mc, attention_sinks(model)),
    )
    mode = forward.graphs.choice
    graphs = step_graphs(model, backend, config, scratch_block=num_blocks + 1) if mode != "off" else None
    runner = ModelRunner(model, backend, config.model.cpu_linear, graphs)
    capture = capture_graphs(graphs) if mode == "on" and graphs is not None else None
    facts = ModelFacts(
        vocab_size=mc.vocab_size,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        probe_block=num_blocks,
        forward=forward,
        eos_token_ids=eos_token_ids(model, tokenizer),
        capture=capture,
    )
    return runner, facts


def step_graphs(model: Any, backend: Any, config: EngineConfig, scratch_block: int) -> StepGraphs:
    """The bucketed steps' buffers (cuda_graphs on or eager)."""
    sc = config.scheduler
    rows = graph_rows(sc.max_num_seqs, sc.max_num_batched_tokens, config)
    return StepGraphs.for_settings(model, backend, scratch_block, rows, sc.max_num_seqs)


def capture_graphs(graphs: StepGraphs) -> CaptureReport:
    logger.info("capturing CUDA graphs for %d step buckets", len(graphs.all_buckets()))
    report = graphs.capture()
    mib = report.bytes / 2**20
    logger.info("CUDA graphs: %d captured in %.1f s, %.0f MiB of device memory", report.graphs, report.seconds, mib)
    return report


def graph_rows(max_num_seqs: int, max_num_batched_tokens: int, config: EngineConfig) -> int:
    """The most rows a step without a prompt chunk can have: every seat's root, draft and window
    rows, within the step's token budget (a larger step runs eagerly)."""
    d = config.draft
    per_request = 1 + (d.decoding_length if d.method != "none" else 0)
    if d.method in ("jacobi", "hybrid"):  # the window's rows and the pooled n-grams' nodes
        per_request += (d.ngram_size - 1) * (d.window_size + d.guesses)
    return max(1, min(max_num_batched_tokens, max_num_seqs * per_request))


def kv_pool_bytes(cache: Any, model_config: Any) -> int:
    """Bytes of the CPU's float32 KV pool `cache` (a CacheConfig) sets for a model config."""
    if cache.num_blocks is None:
        return int(cache.kv_cache_memory_gb * 2**30)
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    per_block = 2 * model_config.num_hidden_layers * cache.block_size * model_config.num_key_value_heads * head_dim * 4
    return cache.num_blocks * per_block


def kv_blocks_for_memory(
    memory_gb: float, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """How many KV blocks (K and V, every layer) fit in `memory_gb` GiB; at least one."""
    bytes_per_block = 2 * num_layers * block_size * num_kv_heads * head_dim * (torch.finfo(dtype).bits // 8)
    return max(1, int(memory_gb * 2**30 // bytes_per_block))


def eos_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """Every end-of-sequence id the model's configs and the tokenizer name, and for a model read
    from a GGUF file every id that ends a generation in llama.cpp (`gguf_vocab`: eot, eom, the chat
    template's end tokens)."""
    from pathlib import Path

    from batchserve.model.gguf_vocab import file_end_of_generation_ids

    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    source = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    if source.suffix == ".gguf" and source.is_file():
        vocab = int(getattr(model.config, "vocab_size", 0) or 0)
        ids.update(i for i in file_end_of_generation_ids(source) if not vocab or i < vocab)
    return frozenset(ids)


def attention_scale(model: Any) -> float | None:
    """The softmax scale the model's attention layers pass (FlashInfer plans it per step)."""
    for module in model.modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, float) and hasattr(module, "layer_idx"):
            return scaling
    return None
