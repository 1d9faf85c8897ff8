"""The native model built straight over a GGUF file's blocks (Llama, Mistral, Qwen2/3, Gemma 2/3,
Phi-3/4 with its merged q|k|v and gate|up, and the routed-expert Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE
and gpt-oss, each expert's products over its rows of the `ffn_*_exps` tensors, gpt-oss's with their
biases and its attention's sinks): no transformers model, no float32 copy, no conversion cache.
Each product is a `BlockLinear` over the tensors' own blocks, whatever type each tensor has (a
llama.cpp mix varies by layer and falls back per tensor); the token embedding looks its rows up in
the mapped file; norms and biases are the file's float32 values.

A tensor whose type has no kernel of ours (IQ1-IQ3, TQ, float matrices, MXFP4 scales past what our
kernel's float16 scale holds) is dequantized
to bfloat16 for our bfloat16 kernel, and the start-up log names each such tensor and its cost. A
file that cannot fit in memory beside the KV pool is refused before anything is read."""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from batchserve import kernels
from batchserve.model.family import local_rotary_for, rotary_for
from batchserve.model.gguf_config import LLAMA_CPP_ARCHS
from batchserve.model.gguf_experts import ExpertsReader, native
from batchserve.model.gguf_file import (
    PERMUTED_ARCHS,
    GGUFRefused,
    GGUFTensors,
    TensorView,
    dequantized,
    read_meta,
    type_name,
)
from batchserve.model.gguf_memory import check_fits
from batchserve.model.llama import NativeLlamaForCausalLM, product_out_dtype, supports
from batchserve.model.moe import SparseMoE, use_kernel_experts

logger = logging.getLogger("batchserve")


class GGUFEmbedding(nn.Module):
    """The token embedding as stored in the file: a step's rows are dequantized from the mapped
    blocks (only the rows asked for are read), float32 out, the file's exact values."""

    def __init__(self, view: TensorView) -> None:
        super().__init__()
        self.view = view
        self.num_embeddings, self.embedding_dim = view.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from gguf import dequantize

        rows = self.view.data[ids.cpu().numpy()]  # [T, row_bytes] (or [T, H] floats)
        out = np.asarray(dequantize(rows, self.view.qtype), dtype=np.float32)
        return torch.from_numpy(out.reshape(ids.shape[0], self.embedding_dim))  # [T, H]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {type_name(self.view.qtype)} rows read from the file"


@dataclass(slots=True)
class LoadReport:
    """What the load made of the file's tensors (the start-up log's line and GetModelInfo's reason)."""

    native: Counter[str] = field(default_factory=Counter)  # block type -> products' parts on our kernels
    dequantized: list[str] = field(default_factory=list)  # tensors run as bfloat16 copies
    dequantized_bytes: int = 0  # what those copies take
    packed_bytes: int = 0  # what the packed blocks take
    float_routers: int = 0  # routers (and shared-expert gates) kept in float32

    def line(self) -> str:
        kinds = ", ".join(f"{k} x{n}" for k, n in sorted(self.native.items()))
        text = f"the file's own blocks on our kernels ({kinds})"
        if self.float_routers:
            text += f"; {self.float_routers} routers in float32"
        if self.dequantized:
            names = ", ".join(self.dequantized[:4]) + (", ..." if len(self.dequantized) > 4 else "")
            mib = self.dequantized_bytes / 2**20
            text += f"; no kernel of ours for {len(self.dequantized)} tensors ({names}): bfloat16 copies, {mib:.0f} MiB"
        return text


def refusal(tensors: GGUFTensors) -> str | None:
    """Why this file's layers cannot be built from its blocks here; None where they can."""
    if tensors.architecture not in LLAMA_CPP_ARCHS:
        return f"architecture {tensors.architecture or '(none)'} (read from blocks: {', '.join(LLAMA_CPP_ARCHS)})"
    if not kernels.available():
        return f"our kernels do not run here: {kernels.unavailable_reason()}"
    from batchserve.model.blocks import block_products_invariant

    if not block_products_invariant():
        return "our block products are not batch-invariant on this CPU"
    return None


def load_gguf_native(path: Path, kv_bytes: Callable[[Any], int] | None = None) -> tuple[NativeLlamaForCausalLM, Any]:
    """(native model, tokenizer) for a GGUF file, its layers over the file's own blocks. Raises
    GGUFRefused where the file cannot be read so (the caller may fall back, saying why)."""
    t0 = time.perf_counter()
    tensors = GGUFTensors(path)
    why = refusal(tensors)
    if why is not None:
        raise GGUFRefused(why)
    config, tokenizer = read_meta(path)
    check_fits(tensors, kv_bytes(config) if kv_bytes is not None else 0)
    config._name_or_path = str(path)
    why = supports(config)
    if why is not None:
        raise GGUFRefused(f"the native forward does not support {why}")
    builder = _Builder(tensors, config)
    model = builder.build()
    logger.info("read %s in %.1f s: %s", path.name, time.perf_counter() - t0, builder.report.line())
    return model, tokenizer


class _Builder(ExpertsReader):
    """Fills a native model's modules from the file, one tensor at a time (a sparse layer's
    experts: `ExpertsReader`)."""

    def __init__(self, tensors: GGUFTensors, config: Any) -> None:
        self.tensors, self.config = tensors, config
        self.report = LoadReport()
        self.permuted = tensors.architecture in PERMUTED_ARCHS
        self.total = sum(v.nbytes for v in tensors.tensors.values())
        self.done = 0
        self.started = self.last_log = time.perf_counter()

    def build(self) -> NativeLlamaForCausalLM:
        from batchserve.model.layer_kernels import TORCH_LAYERS
        from batchserve.model.layers import use_kernel_layers

        c = self.config
        with torch.device("meta"):
            model = NativeLlamaForCausalLM(c, torch.empty(0), 1.0, TORCH_LAYERS)
        model.embed_tokens = GGUFEmbedding(self.tensors["token_embd.weight"])
        for i, layer in enumerate(model.layers):
            self._layer(layer, i)
        model.norm.weight = self._vector("output_norm.weight")
        head = self.tensors.get("output.weight") or self.tensors["token_embd.weight"]
        model.lm_head = self._product("lm_head", [head], None)
        factors = self.tensors.get("rope_freqs.weight")
        model.rotary = rotary_for(c, None if factors is None else np.array(factors.data, dtype=np.float32))
        model.rotary_local = local_rotary_for(c)  # Gemma 3's windowed layers' own
        use_kernel_layers(model)  # norms and silu*up on our kernels, beside our products
        use_kernel_experts(model)  # each sparse layer's experts in one call of our kernel
        left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        if left:
            raise GGUFRefused(f"the file has no weights for {left[:4]}")
        self._finish(model)
        return model.eval()

    def _finish(self, model: NativeLlamaForCausalLM) -> None:
        from transformers import GenerationConfig

        from batchserve.model.bf16 import our_bf16_here
        from batchserve.model.blocks import block_products_invariant
        from batchserve.model.fused import KernelDecoderLayers, why_not_fused

        model.cpu_weights = "gguf"
        model.cpu_weights_reason = self.report.line()
        model.gguf_report = self.report
        model.batch_invariant_linears = block_products_invariant() and (not self.report.dequantized or our_bf16_here())
        model.generation_config = GenerationConfig.from_model_config(self.config)
        # The fused layers rotate whole heads: a partial rotary (Phi's) stays on the layers' own path.
        whole_heads = 2 * model.rotary.inv_freq.numel() == model.layers[0].self_attn.head_dim
        if whole_heads and why_not_fused(model.layers) is None:  # last: it holds the weights' addresses
            model.fused_layers = KernelDecoderLayers(model.layers)

    def _layer(self, layer: nn.Module, i: int) -> None:
        c, blk = self.config, f"blk.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        d, kv = attn.head_dim, c.num_key_value_heads
        merged = self.tensors.get(f"{blk}attn_qkv.weight")
        if merged is not None:  # Phi-3: q|k|v stored as one tensor, our merged product's own order
            qkv, sizes = [merged], (c.num_attention_heads * d, kv * d, kv * d)
        else:
            q, k, v = (self.tensors[f"{blk}attn_{p}.weight"] for p in "qkv")
            if self.permuted:
                q, k = self._unpermuted(q, c.num_attention_heads), self._unpermuted(k, kv)
            qkv, sizes = [q, k, v], None
        bias = None
        if self.tensors.get(f"{blk}attn_q.bias") is not None:
            bias = torch.cat([self._vector(f"{blk}attn_{p}.bias").data for p in "qkv"])
        attn.qkv_proj = self._product(f"layers.{i}.self_attn.qkv_proj", qkv, bias, sizes)
        if attn.q_norm is not None and attn.k_norm is not None:  # per-head q/k norms (qwen3)
            attn.q_norm.weight = self._vector(f"{blk}attn_q_norm.weight")
            attn.k_norm.weight = self._vector(f"{blk}attn_k_norm.weight")
            if (attn.q_norm.weight.numel(), attn.k_norm.weight.numel()) != attn.norm_spans:
                raise GGUFRefused(
                    f"{blk}attn_q_norm and attn_k_norm have {attn.q_norm.weight.numel()} and"
                    f" {attn.k_norm.weight.numel()} values; the model's norms span {attn.norm_spans}"
                )
        o_bias = None
        if self.tensors.get(f"{blk}attn_output.bias") is not None:  # gpt-oss's
            o_bias = self._vector(f"{blk}attn_output.bias").data
        attn.o_proj = self._product(f"layers.{i}.self_attn.o_proj", [self.tensors[f"{blk}attn_output.weight"]], o_bias)
        if attn.sinks is not None:  # gpt-oss: a sink logit per query head
            attn.sinks = self._vector(f"{blk}attn_sinks.weight")
        if isinstance(mlp, SparseMoE):
            self._experts(mlp, i)
        else:
            self._mlp(mlp, i)
        # Norms as the file stores them: llama.cpp's converter has already added Gemma's 1 to its weights.
        layer.input_layernorm.weight = self._vector(f"{blk}attn_norm.weight")
        if layer.sandwich:  # Gemma: the attention's output normed, the MLP's input and output
            layer.post_attention_layernorm.weight = self._vector(f"{blk}post_attention_norm.weight")
            layer.pre_feedforward_layernorm.weight = self._vector(f"{blk}ffn_norm.weight")
            layer.post_feedforward_layernorm.weight = self._vector(f"{blk}post_ffw_norm.weight")
        else:  # gpt-oss's file names the MLP's input norm `post_attention_norm`
            norm = "ffn_norm" if self.tensors.get(f"{blk}ffn_norm.weight") is not None else "post_attention_norm"
            layer.post_attention_layernorm.weight = self._vector(f"{blk}{norm}.weight")

    def _mlp(self, mlp: nn.Module, i: int, suffix: str = "", path: str = "mlp") -> None:
        """A dense MLP's products (`suffix` `_shexp`: a sparse layer's shared expert, at `path`)."""
        c, blk = self.config, f"blk.{i}."
        up = self.tensors[f"{blk}ffn_up{suffix}.weight"]
        gate = self.tensors.get(f"{blk}ffn_gate{suffix}.weight")
        name = f"layers.{i}.{path}"
        if gate is None:  # Phi-3: gate|up stored as one tensor (ffn_up), the gate's rows first
            ff = c.intermediate_size
            if up.shape[0] != 2 * ff:
                raise GGUFRefused(f"{blk}ffn_up has {up.shape[0]} rows and no ffn_gate: expected gate|up, 2 x {ff}")
            mlp.gate_up_proj = self._product(f"{name}.gate_up_proj", [up], None, (ff, ff))
        else:
            mlp.gate_up_proj = self._product(f"{name}.gate_up_proj", [gate, up], None)
        mlp.down_proj = self._product(f"{name}.down_proj", [self.tensors[f"{blk}ffn_down{suffix}.weight"]], None)

    def _unpermuted(self, view: TensorView, heads: int) -> TensorView:
        """llama.cpp's converter interleaves each head's rotary halves in attn_q/attn_k; the rows
        back in transformers' order (a row is a whole run of blocks, so rows move as they are)."""
        rows = view.shape[0]
        order = np.arange(rows).reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(rows)
        return TensorView(view.name, view.qtype, view.shape, view.data[order], view.offset, view.nbytes)

    def _vector(self, name: str) -> nn.Parameter:
        view = self.tensors[name]
        values = view.data if view.qtype == 0 else dequantized(view)
        return nn.Parameter(torch.from_numpy(np.array(values, dtype=np.float32).reshape(-1)), requires_grad=False)

    def _product(
        self,
        name: str,
        views: list[TensorView],
        bias: torch.Tensor | None,
        sizes: tuple[int, ...] | None = None,
        arena: Any = None,
    ) -> nn.Module:
        """One product over `views`' rows joined; `sizes`: its parts' rows where a view holds several;
        `arena`: where its packed weights go (else a buffer of its own)."""
        from batchserve.model.blocks import BlockLinear, BlockPart

        sizes = sizes or tuple(v.shape[0] for v in views)
        if sum(sizes) != sum(v.shape[0] for v in views):
            raise GGUFRefused(f"{name}: the file's {sum(v.shape[0] for v in views)} rows are not the model's {sizes}")
        if all(native(v) for v in views):
            parts = [BlockPart(v.data, v.qtype, v.shape[1]) for v in views]
            layer: nn.Module = BlockLinear(parts, bias, sizes, arena)
            self.report.native.update(type_name(v.qtype) for v in views)
            self.report.packed_bytes += sum(v.nbytes for v in views)
        else:
            layer = self._bf16(name, views, bias, sizes)
        for view in views:
            self._progress(view)
        return layer

    def _bf16(self, name: str, views: list[TensorView], bias: torch.Tensor | None, sizes: tuple[int, ...]) -> nn.Module:
        from batchserve.model.bf16 import KernelBf16Linear, our_bf16_here
        from batchserve.model.layers import MergedLinear, PackedLinear

        weight = torch.from_numpy(np.concatenate([dequantized(v) for v in views]))  # [N, K] float32, one product's
        linear = MergedLinear(weight.shape[1], sizes, bias=bias is not None)
        with torch.no_grad():
            linear.weight.copy_(weight)
            if bias is not None:
                linear.bias.copy_(bias)
        del weight
        self.report.dequantized += [f"{v.name} ({type_name(v.qtype)})" for v in views]
        self.report.dequantized_bytes += 2 * linear.weight.numel()
        if not our_bf16_here():  # float32 on oneDNN's packed product: no bfloat16 kernel of ours here
            return PackedLinear(linear)
        return KernelBf16Linear(linear, product_out_dtype(name))

    def _progress(self, view: TensorView) -> None:
        """The mapping's pages of a packed tensor released; a log line every few seconds."""
        self.tensors.release(view)
        self.done += view.nbytes
        now = time.perf_counter()
        if now - self.last_log >= 3.0:
            self.last_log = now
            rate = self.done / max(now - self.started, 1e-9) / 2**20
            logger.info(
                "reading %s: %.0f%% (%.0f of %.0f MiB, %.0f MiB/s)",
                self.tensors.path.name, 100 * self.done / self.total, self.done / 2**20, self.total / 2**20, rate,
            )  # fmt: skip
