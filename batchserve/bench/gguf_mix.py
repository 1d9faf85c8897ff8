"""llama.cpp's quantization mixes: the type `llama-quantize` gives each tensor of a Llama-family
shape in each `--type` (the first and last eighth of layers and every third between get more bits
under the _M mixes; rows that are not a multiple of 256 fall back to a 32-value type), the planned
tensors of a file and its size (../shared notes: gguf-blocks.md, section 3)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from batchserve.bench.shapes import ModelShape, get_shape

Q = GGMLQuantizationType


@dataclass(frozen=True, slots=True)
class Quant:
    """A `--quant` name: its default type, its llama.cpp file type, and whether llama-quantize's
    mix rules apply (False: every 2-D weight is the default type, as with `--pure`)."""

    default: GGMLQuantizationType
    file_type: LlamaFileType
    mix: bool = True


QUANTS: dict[str, Quant] = {
    "Q4_K_M": Quant(Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_M),
    "Q5_K_M": Quant(Q.Q5_K, LlamaFileType.MOSTLY_Q5_K_M),
    "Q6_K": Quant(Q.Q6_K, LlamaFileType.MOSTLY_Q6_K),
    "Q8_0": Quant(Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "Q4_0": Quant(Q.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "Q4_1": Quant(Q.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "Q3_K_M": Quant(Q.Q3_K, LlamaFileType.MOSTLY_Q3_K_M),
    "Q2_K": Quant(Q.Q2_K, LlamaFileType.MOSTLY_Q2_K),
    "IQ4_XS": Quant(Q.IQ4_XS, LlamaFileType.MOSTLY_IQ4_XS),
    "IQ4_NL": Quant(Q.IQ4_NL, LlamaFileType.MOSTLY_IQ4_NL),
    "Q5_0": Quant(Q.Q5_0, LlamaFileType.MOSTLY_Q5_0),
    "Q5_1": Quant(Q.Q5_1, LlamaFileType.MOSTLY_Q5_1),
    # No llama.cpp file type is one K-quant throughout: these are `--pure` Q4_K_S / Q5_K_S.
    "Q4_K": Quant(Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_S, mix=False),
    "Q5_K": Quant(Q.Q5_K, LlamaFileType.MOSTLY_Q5_K_S, mix=False),
    "F16": Quant(Q.F16, LlamaFileType.MOSTLY_F16, mix=False),
    "BF16": Quant(Q.BF16, LlamaFileType.MOSTLY_BF16, mix=False),
    "F32": Quant(Q.F32, LlamaFileType.ALL_F32, mix=False),
    # llama-quantize's MXFP4_MOE: routed experts in MXFP4, every other matrix Q8_0 (gpt-oss's).
    "MXFP4_MOE": Quant(Q.Q8_0, LlamaFileType.MOSTLY_MXFP4_MOE, mix=False),
}
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
# llama-quantize's `tensor_type_fallback` for a row that is not a multiple of 256.
FALLBACK = {Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0, Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.IQ4_XS: Q.IQ4_NL}
F = LlamaFileType


@dataclass(frozen=True, slots=True)
class PlannedTensor:
    """One tensor of the file: its llama.cpp name, numpy shape ((experts,) rows, row length) or (n,), type."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType

    @property
    def nbytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.qtype]
        return int(np.prod(self.shape[:-1], dtype=np.int64)) * (self.shape[-1] // block) * size


def use_more_bits(i: int, n: int) -> bool:
    """llama-quantize's layers that get more bits: the first and last eighth and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _get_quant(quant: str) -> Quant:
    if quant not in QUANTS:
        raise ValueError(f"unknown quantization {quant!r}: one of {', '.join(QUANTS)}")
    return QUANTS[quant]


def _as_shape(shape: ModelShape | str) -> ModelShape:
    return get_shape(shape) if isinstance(shape, str) else shape


# File types whose attn_output llama-quantize raises to Q5_K in a model of 8 experts (Mixtral).
EIGHT_EXPERT_OUTPUT = (F.MOSTLY_Q2_K, F.MOSTLY_Q3_K_M, F.MOSTLY_IQ4_NL, F.MOSTLY_Q4_K_M, F.MOSTLY_IQ4_XS)


def _bumped(
    ft: LlamaFileType, name: str, layer: int, n_layer: int, gqa: int, experts: int = 0
) -> GGMLQuantizationType | None:
    """llama-quantize's type for attn_v, attn_k, ffn_down (an expert's and a shared expert's
    too: any name holding `ffn_down`) or attn_output under file type `ft` where it is not the
    default (`llama_tensor_get_type_impl`, without an imatrix), else None."""
    iq4 = ft in (F.MOSTLY_IQ4_XS, F.MOSTLY_IQ4_NL)
    if experts == 8 and name.endswith(("attn_v.weight", "attn_k.weight")):
        return Q.Q8_0  # "for the 8-expert model, bumping this to Q8_0 trades just ~128MB"
    if name.endswith("attn_v.weight"):
        if ft == F.MOSTLY_Q2_K:
            return Q.Q4_K if gqa >= 4 or experts >= 4 else Q.Q3_K
        if ft == F.MOSTLY_Q3_K_M:
            return Q.Q5_K if layer < 2 else Q.Q4_K
        if iq4 and gqa >= 4:
            return Q.Q5_K
        if ft in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and use_more_bits(layer, n_layer):
            return Q.Q6_K
    elif "ffn_down" in name:
        if ft == F.MOSTLY_Q2_K:
            return Q.Q3_K
        if ft == F.MOSTLY_Q3_K_M:
            return Q.Q5_K if layer < n_layer // 16 else Q.Q4_K
        if ft in (F.MOSTLY_Q4_K_M, F.MOSTLY_Q5_K_M) and use_more_bits(layer, n_layer):
            return Q.Q6_K
        if iq4 and layer < n_layer // 8:
            return Q.Q5_K
    elif name.endswith("attn_output.weight"):
        if experts == 8:
            return Q.Q5_K if ft in EIGHT_EXPERT_OUTPUT else None
        return {F.MOSTLY_Q2_K: Q.Q3_K, F.MOSTLY_Q3_K_M: Q.Q4_K}.get(ft)
    return None


def _weight_type(
    q: Quant, name: str, ne0: int, layer: int, n_layer: int, is_output: bool, gqa: int = 1, experts: int = 0
) -> GGMLQuantizationType:
    """The type llama-quantize gives the weight `name` with rows of `ne0` values (`gqa`: query
    heads per KV head; `experts`: the model's routed experts, 0 for a dense model)."""
    t = q.default
    if q.mix and t not in FLOAT_TYPES:
        block = GGML_QUANT_SIZES[t][0]
        if is_output and ne0 % block:  # output.weight, or token_embd when tied
            t = Q.Q8_0
        elif is_output and t != Q.Q8_0:
            t = Q.Q6_K
        elif not is_output:
            t = _bumped(q.file_type, name, layer, n_layer, gqa, experts) or t
    if t not in FLOAT_TYPES and ne0 % GGML_QUANT_SIZES[t][0]:
        t = FALLBACK.get(t, t)
        if ne0 % GGML_QUANT_SIZES[t][0]:
            t = Q.F16  # llama.cpp: F16 after a fallback; a 32-block type it would refuse
    return t


def plan(shape: ModelShape | str, quant: str) -> list[PlannedTensor]:
    """Every tensor of the file in write order: token_embd, each layer's, output_norm, output."""
    s, q = _as_shape(shape), _get_quant(quant)
    h, n, d = s.hidden_size, s.num_hidden_layers, s.head_dim
    q_out, kv_out = s.num_attention_heads * d, s.num_key_value_heads * d
    gemma = s.arch in ("gemma2", "gemma3")

    def weight(name: str, rows: int, ne0: int, layer: int = 0, is_output: bool = False) -> PlannedTensor:
        gqa = s.num_attention_heads // s.num_key_value_heads
        return PlannedTensor(name, (rows, ne0), _weight_type(q, name, ne0, layer, n, is_output, gqa, s.experts))

    def experts(name: str, rows: int, ne0: int, layer: int) -> PlannedTensor:  # every expert's, stacked
        planned = dataclasses.replace(weight(name, rows, ne0, layer), shape=(s.experts, rows, ne0))
        return dataclasses.replace(planned, qtype=Q.MXFP4) if q.file_type == F.MOSTLY_MXFP4_MOE else planned

    oss = s.arch == "gpt-oss"  # biases on o, the router and the experts; sinks; the MLP's norm by another name

    tensors = [weight("token_embd.weight", s.vocab_size, h, is_output=s.tied_embeddings)]
    for i in range(n):
        b = f"blk.{i}"
        tensors.append(PlannedTensor(f"{b}.attn_norm.weight", (h,), Q.F32))
        for proj, rows in (("q", q_out), ("k", kv_out), ("v", kv_out)):
            tensors.append(weight(f"{b}.attn_{proj}.weight", rows, h, i))
            if s.qkv_bias:
                tensors.append(PlannedTensor(f"{b}.attn_{proj}.bias", (rows,), Q.F32))
            if s.arch in ("qwen3", "qwen3moe", "gemma3") and proj in "qk":  # an RMSNorm over each head of q and k
                tensors.append(PlannedTensor(f"{b}.attn_{proj}_norm.weight", (d,), Q.F32))
            if s.arch == "olmoe" and proj in "qk":  # an RMSNorm over all of q and all of k
                tensors.append(PlannedTensor(f"{b}.attn_{proj}_norm.weight", (rows,), Q.F32))
        tensors.append(weight(f"{b}.attn_output.weight", h, q_out, i))
        if oss:
            tensors.append(PlannedTensor(f"{b}.attn_output.bias", (h,), Q.F32))
            tensors.append(PlannedTensor(f"{b}.attn_sinks.weight", (s.num_attention_heads,), Q.F32))
        if gemma:  # Gemma's norm of the attention's output, before the residual add
            tensors.append(PlannedTensor(f"{b}.post_attention_norm.weight", (h,), Q.F32))
        tensors.append(PlannedTensor(f"{b}.{'post_attention' if oss else 'ffn'}_norm.weight", (h,), Q.F32))
        tensors += _ffn(s, b, i, weight, experts)
        if gemma:  # and of the MLP's output
            tensors.append(PlannedTensor(f"{b}.post_ffw_norm.weight", (h,), Q.F32))
    tensors.append(PlannedTensor("output_norm.weight", (h,), Q.F32))
    if not s.tied_embeddings:
        tensors.append(weight("output.weight", s.vocab_size, h, is_output=True))
    return tensors


def _ffn(
    s: ModelShape,
    b: str,
    i: int,
    weight: Callable[[str, int, int, int], PlannedTensor],
    experts: Callable[[str, int, int, int], PlannedTensor],
) -> list[PlannedTensor]:
    """Layer `i`'s MLP tensors (block prefix `b`): dense, or the router and the stacked experts (and
    gpt-oss's biases, Qwen2-MoE's shared expert)."""
    h, oss = s.hidden_size, s.arch == "gpt-oss"
    out: list[PlannedTensor] = []
    if s.experts:  # the router (llama-quantize keeps it as the converter wrote it: F32), the experts
        e = s.expert_intermediate
        out += [
            PlannedTensor(f"{b}.ffn_gate_inp.weight", (s.experts, h), Q.F32),
            experts(f"{b}.ffn_gate_exps.weight", e, h, i),
            experts(f"{b}.ffn_up_exps.weight", e, h, i),
            experts(f"{b}.ffn_down_exps.weight", h, e, i),
        ]
        if oss:
            out += [
                PlannedTensor(f"{b}.ffn_gate_inp.bias", (s.experts,), Q.F32),
                *(PlannedTensor(f"{b}.ffn_{p}_exps.bias", (s.experts, e), Q.F32) for p in ("gate", "up")),
                PlannedTensor(f"{b}.ffn_down_exps.bias", (s.experts, h), Q.F32),
            ]
    if s.shared_expert_intermediate:  # Qwen2-MoE's shared expert and its one-logit gate
        e = s.shared_expert_intermediate
        out += [
            PlannedTensor(f"{b}.ffn_gate_inp_shexp.weight", (h,), Q.F32),
            weight(f"{b}.ffn_gate_shexp.weight", e, h, i),
            weight(f"{b}.ffn_up_shexp.weight", e, h, i),
            weight(f"{b}.ffn_down_shexp.weight", h, e, i),
        ]
    if not s.experts:
        out += [
            weight(f"{b}.ffn_gate.weight", s.intermediate_size, h, i),
            weight(f"{b}.ffn_up.weight", s.intermediate_size, h, i),
            weight(f"{b}.ffn_down.weight", h, s.intermediate_size, i),
        ]
    return out


def tensor_types(shape: ModelShape | str, quant: str) -> dict[str, GGMLQuantizationType]:
    """Each tensor's type under `quant` (the mix's rule applied per tensor name), in file order."""
    return {t.name: t.qtype for t in plan(shape, quant)}


def _padded(nbytes: int, align: int = 32) -> int:
    return -(-nbytes // align) * align


def planned_bytes(shape: ModelShape | str, quant: str) -> int:
    """The tensor data's bytes in the file (each tensor padded to the 32-byte alignment): the
    file's size less its metadata (a few MB: the tokenizer)."""
    return sum(_padded(t.nbytes) for t in plan(shape, quant))


def type_counts(tensors: list[PlannedTensor]) -> dict[str, int]:
    """How many tensors of each type, most first."""
    return dict(Counter(t.qtype.name for t in tensors).most_common())


# Random blocks. Each filler takes a (blocks, block bytes) uint8 array of random bytes and
# overwrites its scales so that a weight is about N(0, std) in magnitude with a zero mean.
# The q codes stay uniform: Q4 codes have std 4.61 (sqrt(255/12)), Q5 9.23, Q6 18.5, Q8 73.6.
