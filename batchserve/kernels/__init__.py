"""Our CPU kernels (csrc/): products over a GGUF file's quantized blocks (block_gemm.cpp: Q4_0 ..
Q8_0, IQ4_NL, Q2_K .. Q6_K and IQ4_XS repacked by block_pack.cpp), over bfloat16 weights
(bf16_gemm.cpp), paged attention (attention.cpp) and a model's decoder layers in one call
(layers.cpp), compiled for this CPU on first use and loaded as an extension module (bindings.cpp).

The library is built once per source, compiler and CPU with `g++ -O3 -march=native -fopenmp`
($CXX overrides the compiler) into $BATCHSERVE_BUILD_DIR/kernels (else $BATCHSERVE_CACHE_DIR, else
~/.cache/batchserve), which takes a few seconds; `make setup` builds it ahead. Its OpenMP calls
resolve to the runtime torch already loaded (the same soname), so its threads are torch's threads. Where it
cannot be built (no compiler, a CPU without AVX2, FMA and F16C), `available()` is False and
`unavailable_reason()` says why: a GGUF file is then loaded through transformers (bfloat16 or
float32 products), bfloat16 products run on oneDNN's (where its check passes), and attention on
the torch-op backends."""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path
from typing import Any

import torch

from batchserve import native_build

log = logging.getLogger(__name__)

SOURCES = tuple(sorted((Path(__file__).parent / "csrc").glob("*.cpp")))
HEADERS = tuple(sorted((Path(__file__).parent / "csrc").glob("*.h")))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-std=c++17", "-shared", "-fPIC")
NEEDED_CPU_FLAGS = ("avx2", "fma", "f16c")  # what the kernels' instructions need
ABI_VERSION = 11  # bs_abi_version() of the source this module's signatures describe
MODULE = "_batchserve_cpu"  # the extension module's name (bindings.cpp)


class KernelUnavailable(RuntimeError):
    """The kernels cannot run here; the message says why."""


def cache_root() -> Path:
    return native_build.build_root("kernels")


def compiler() -> str | None:
    return native_build.compiler()


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def build(verbose: bool = False) -> Path:
    """The library for this CPU, compiled now unless already built; raises KernelUnavailable.
    A new CPU builds anew: -march=native code must not run on another CPU."""
    if platform.machine() not in ("x86_64", "AMD64"):
        raise KernelUnavailable(f"the kernels are x86-64 (AVX2) code; this machine is {platform.machine()}")
    missing = [flag for flag in NEEDED_CPU_FLAGS if flag not in cpu_flags()]
    if missing:
        raise KernelUnavailable(f"this CPU lacks {', '.join(missing)}")
    if verbose:
        log.info("building our CPU kernels (once per source, compiler and CPU)")
    cpu = " ".join(sorted(cpu_flags())).encode()
    try:
        return native_build.build("our kernels", "kernels", "batchserve_cpu", SOURCES, HEADERS, FLAGS, cpu)
    except native_build.BuildFailed as e:
        raise KernelUnavailable(str(e)) from None


@functools.cache
def _load() -> Any:
    try:
        path = build(verbose=True)
    except (KernelUnavailable, OSError) as e:
        return str(e)
    lib = native_build.load(MODULE, path)
    if lib.abi_version() != ABI_VERSION:
        return f"{path} is not this version's build"
    return lib


def build_id() -> str:
    """A name for this build of our kernels (source, compiler, CPU): what a cost profile measured
    on them depends on. Empty where they are unavailable."""
    lib = _load()
    return "" if isinstance(lib, str) else Path(lib.__file__).stem.rpartition("-")[2]


def library() -> Any:
    """The loaded kernels; raises KernelUnavailable (with the reason) where there are none."""
    lib = _load()
    if isinstance(lib, str):
        raise KernelUnavailable(lib)
    return lib


def available() -> bool:
    return not isinstance(_load(), str)


def unavailable_reason() -> str | None:
    lib = _load()
    return lib if isinstance(lib, str) else None


def bf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """A weight [N, K] (any float dtype: rounded to bfloat16) -> `bf16_linear`'s layout, 1-D
    bfloat16 (opaque: the column grouping follows the kernel this CPU compiled, csrc/bf16_gemm.cpp)."""
    n, k = weight.shape
    w = weight.detach().to(torch.bfloat16).contiguous()  # [N, K]
    lib = library()
    packed = torch.empty(int(lib.bf16_packed_size(n, k)), dtype=torch.bfloat16)
    lib.bf16_pack(w.data_ptr(), n, k, packed.data_ptr(), torch.get_num_threads())
    return packed


def bf16_columns() -> int:
    """Output columns a group of `bf16_pack`'s layout holds: 16 where the kernel was compiled for
    AVX-512 (with AVX512-BF16's dot products or without), 8 for AVX2."""
    return int(library().bf16_columns())


def bf16_linear(x: torch.Tensor, packed: torch.Tensor, n: int, out_dtype: torch.dtype) -> torch.Tensor:
    """x [T, K] float32 (contiguous), rounded to bfloat16, times a `bf16_pack`ed weight [N, K]
    transposed -> [T, N] in `out_dtype` (float32, or bfloat16 rounded from the float32 sums)."""
    if out_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"bf16_linear writes float32 or bfloat16, not {out_dtype}")
    rows, k = x.shape
    y = torch.empty(rows, n, dtype=out_dtype)
    narrow = int(out_dtype == torch.bfloat16)
    library().bf16_linear(x.data_ptr(), rows, k, packed.data_ptr(), n, y.data_ptr(), narrow, torch.get_num_threads())
    return y


def main() -> None:
    """`python -m batchserve.kernels`: build now (make setup), or say why not."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(f"our CPU kernels: {build(verbose=True)}")
    except KernelUnavailable as e:
        print(f"our CPU kernels unavailable (GGUF files load through transformers, attention on torch ops): {e}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: Any,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write k, v [Hkv, T, D] (float32, unit stride in a row) to the layer's pool keys and values
    [Hkv, S, D] at `plan.slot_mapping`, then attend q [Hq, T, D] (likewise) over each row's keys
    as `plan` lists them (`attention.kernel.KernelMetadata`) -> [T, Hq, D] float32. `softcap` > 0:
    each scaled score s becomes softcap * tanh(s / softcap) first. `sinks` [Hq] float32
    contiguous: each head's sink logit, in its softmax's max and denominator."""
    hq, t, d = q.shape
    hkv, s = keys.shape[0], keys.shape[1]
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1 or not keys.is_contiguous():
        raise ValueError("attention needs unit-stride rows and a contiguous pool")
    out = torch.empty(t, hq, d)
    library().attention(
        q.data_ptr(), q.stride(0), q.stride(1), t, hq, hkv, d,
        k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
        plan.slot_mapping.data_ptr(), keys.data_ptr(), values.data_ptr(), s,
        plan.slots.data_ptr(), plan.prefix_at.data_ptr(), plan.prefix_len.data_ptr(),
        plan.tails.data_ptr(), plan.tail_at.data_ptr(), plan.tail_len.data_ptr(),
        scale, softcap, 0 if sinks is None else sinks.data_ptr(), out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(normed, x + residual or None) for x, residual [T, H] float32 contiguous, H % 8 == 0."""
    t, h = x.shape
    normed = torch.empty(t, h)
    summed = None if residual is None else torch.empty(t, h)
    library().rms_norm(
        x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(), t, h, eps,
        normed.data_ptr(), 0 if summed is None else summed.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return normed, summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [T, I] for gate|up [T, 2I] float32 contiguous, I % 8 == 0."""
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, i)
    library().silu_mul(gate_up.data_ptr(), t, i, out.data_ptr(), torch.get_num_threads())
    return out


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU [T, I] for gate|up [T, 2I] float32 contiguous, I % 8 == 0
    (`layers.ClampedSwiGLU`'s operations in its order, the sigmoid from our exp)."""
    t, i = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(t, i)
    library().clamped_swiglu(gate_up.data_ptr(), t, i, alpha, limit, out.data_ptr(), torch.get_num_threads())
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [heads, T, D] (unit stride in a row, D % 16 == 0) rotated by cos and signed sin [T, D]
    (contiguous) -> contiguous [heads, T, D], the bits of `Rotary.apply`'s torch ops."""
    heads, t, d = x.shape
    out = torch.empty(heads, t, d)
    library().rotary(
        x.data_ptr(), heads, t, d, x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def layer_fields() -> int:
    """Columns of `decoder_layers`' layer table (csrc/layers.cpp's Field)."""
    return int(library().layer_fields())


def decoder_layers(
    table: torch.Tensor,
    x: torch.Tensor,
    shape: tuple[int, int, int, int, int],
    routing: tuple[int, int, int],
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    plan: Any,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Every decoder layer of `table` ([L, layer_fields()] int64: the layers' tensors' addresses)
    over x [T, H] float32 contiguous, with `shape` = (H, Hq, Hkv, D, I), `routing` = (E, k, route
    flags) of the sparse layers (E 0: none; csrc/layers.cpp), cos and sin [T, D]
    contiguous, `plan` the step's attention plan (`attention.kernel.KernelMetadata`) and keys,
    values the pool [L, Hkv, S, D] -> (the last layer's output [T, H], the residual beside it,
    the seconds attention took)."""
    t = x.shape[0]
    lib = library()
    work = torch.empty(int(lib.layers_workspace(t, *shape, *routing[:2])))
    out, residual = torch.empty(t, shape[0]), torch.empty(t, shape[0])
    seconds = lib.decoder_layers(
        table.data_ptr(), table.shape[0], x.data_ptr(), t, *shape, *routing, eps, cos.data_ptr(), sin.data_ptr(),
        plan.slot_mapping.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.shape[2],
        plan.slots.data_ptr(), plan.prefix_at.data_ptr(), plan.prefix_len.data_ptr(),
        plan.tails.data_ptr(), plan.tail_at.data_ptr(), plan.tail_len.data_ptr(),
        scale, work.data_ptr(), out.data_ptr(), residual.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out, residual, float(seconds)


def block_packed_size(qtype: int, rows: int, cols: int) -> int:
    """Bytes of `block_pack`'s layout of a [rows, cols] weight of GGML type `qtype` (0: not ours)."""
    return int(library().block_packed_size(qtype, rows, cols))


def block_pack(raw: Any, qtype: int, rows: int, cols: int, out: torch.Tensor) -> None:
    """The file's blocks `raw` (a numpy uint8 array [rows, row bytes], unit stride in a row: read
    only) of GGML type `qtype` -> the kernel layout (csrc/blocks.h) into `out`, a contiguous uint8
    tensor of `block_packed_size` bytes (or more), rows padded with zeros to whole groups (16 for
    the paired Q4_0, Q8_0 and IQ4_NL records, else 8)."""
    if raw.dtype.itemsize != 1 or raw.ndim != 2 or raw.shape[0] != rows or raw.strides[1] != 1:
        raise ValueError(f"block_pack reads uint8 rows with unit stride, got {raw.dtype} {raw.shape} {raw.strides}")
    if out.dtype != torch.uint8 or not out.is_contiguous() or out.numel() < block_packed_size(qtype, rows, cols):
        raise ValueError("block_pack writes a contiguous uint8 tensor of block_packed_size bytes")
    address = raw.__array_interface__["data"][0]  # a read-only memmap's address too
    library().block_pack(qtype, address, rows, cols, raw.strides[0], out.data_ptr(), torch.get_num_threads())


def block_linear(x: torch.Tensor, desc: torch.Tensor, n: int) -> torch.Tensor:
    """x [T, K] float32 (contiguous) times the product `desc` describes (csrc/blocks.h: an int64
    tensor [3 + 3 P] = K, N, P, then each part's type, rows, packed weights' address) -> [T, N] float32."""
    y = torch.empty(x.shape[0], n)
    library().block_linear(x.data_ptr(), x.shape[0], desc.data_ptr(), y.data_ptr(), torch.get_num_threads())
    return y


def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    i: int,
    clamp: tuple[float, float] | None = None,
) -> torch.Tensor:
    """A sparse layer's routed experts (csrc/moe.cpp) over x [T, H] float32 contiguous: ids [T, k]
    int64 and weights [T, k] float32 (contiguous) each row's experts and their weights, experts
    [E, 4] int64 each expert's gate|up (2 `i` outputs) and down (H outputs) product descriptors'
    addresses and their float32 biases' (0: none) -> [T, H] float32: each row's weighted outputs
    added in ascending expert order. The activation: silu(gate) * up, or with `clamp` (alpha,
    limit) the clamped SwiGLU (`clamped_swiglu`)."""
    alpha, limit = clamp if clamp is not None else (0.0, 0.0)
    t, h = x.shape
    lib, threads = library(), torch.get_num_threads()
    work = torch.empty(int(lib.moe_workspace(t, h, ids.shape[1])))
    out = torch.empty(t, h)
    lib.moe_experts(
        x.data_ptr(), t, h, ids.shape[1], ids.data_ptr(), weights.data_ptr(), experts.data_ptr(), experts.shape[0],
        i, alpha, limit, work.data_ptr(), out.data_ptr(), threads,
    )  # fmt: skip
    return out


def router_logits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A router's float32 product (csrc/router.cpp): x [T, H] float32 contiguous, weight [N, H]
    float32 contiguous (H % 8 == 0), bias [N] or None -> [T, N], each logit one fixed-order sum."""
    t, h = x.shape
    out = torch.empty(t, weight.shape[0])
    library().router_logits(
        x.data_ptr(), t, h, weight.data_ptr(), 0 if bias is None else bias.data_ptr(), weight.shape[0],
        out.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return out


def moe_route(
    logits: torch.Tensor, experts: int, k: int, softmax_first: bool, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k experts of the first `experts` of logits [T, N >= experts] float32 contiguous
    (`moe.Routing.route`'s rules, csrc/router.cpp) -> (weights [T, k] float32, ids [T, k] int64)."""
    t = logits.shape[0]
    ids, weights = torch.empty(t, k, dtype=torch.int64), torch.empty(t, k)
    library().moe_route(
        logits.data_ptr(), t, logits.shape[1], experts, k, int(softmax_first), int(renormalize), ids.data_ptr(),
        weights.data_ptr(), torch.get_num_threads(),
    )  # fmt: skip
    return weights, ids


def block_wide() -> bool:
    """Whether the block products were compiled with 512-bit tiles (AVX-512 VNNI)."""
    return bool(library().block_wide())
