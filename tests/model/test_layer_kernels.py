"""The decoder layer's kernels, chosen once when the model is built (`LayerKernels`): torch's ops
(every CPU model: their bits are the ones the other tests hold to transformers), or FlashInfer's
fused ops on CUDA. Here: how many ops a layer dispatches on torch's path (a regression guard), and
the FlashInfer layers' code run on the CPU over pure-torch stand-ins of FlashInfer's functions
(`flashinfer_standin`), checked against torch's layers and counted."""

from __future__ import annotations

import collections
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from batchserve.model import native_from_hf
from batchserve.model.layer_kernels import (
    TORCH_LAYERS,
    FlashInferRMSNorm,
    FlashInferRotary,
    FlashInferSiluAndMul,
    LayerKernels,
    choose_layer_kernels,
    flashinfer_layers,
)
from batchserve.model.layers import RMSNorm, Rotary, SiluAndMul
from batchserve.runner.forward import Part, _fused_part
from tests.conftest import make_tiny_fa2_model
from tests.model.flashinfer_standin import LIBRARY

STANDIN = flashinfer_layers(LIBRARY, "FlashInfer's functions stood in for by torch ops", device="cpu")

# Ops that only allocate (no kernel runs).
ALLOCATIONS = frozenset(
    f"aten.{op}" for op in ("empty.memory_format", "empty_like.default", "new_empty.default", "empty_strided.default")
)

# Kernels one decoder layer after the first (the residual add fused into its norms) dispatches on
# torch's path in bfloat16 (the GPU's dtype; on the CPU float32 rotates on our kernel, which no
# dispatch sees), 4 rows, torch 2.13, counted by `KernelCount` with the attention double below as
# one kernel: 2 RMSNorms x 9 (the residual add, to float32, pow, mean, + eps, rsqrt, mul, to
# bfloat16, * weight), 4 products (q|k|v, o, gate|up, down), the rotation 4 (roll, mul_, mul, add_),
# silu*up 2, attention 1. Issue 77 measured about 30 CUDA kernels a layer on an H100 for this path.
# A regression guard: an op added to the layer fails it (and one removed asks for the new number).
TORCH_LAYER_KERNELS = 29
# The same layer on FlashInfer's fused ops (each stand-in one kernel, as each FlashInfer op is):
# fused add + RMSNorm x 2, 4 products, the rotation 1, silu*up 1, attention 1.
FLASHINFER_LAYER_KERNELS = 9


class KernelCount(TorchDispatchMode):
    """Counts the ops dispatched inside it that run a kernel: every op that writes in place or
    returns a tensor over new memory (not a view, not `reshape`/`contiguous`/`to` returning its
    input), except ops that only allocate. A custom op (FlashInfer's, or a stand-in) counts once."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    @property
    def kernels(self) -> int:
        return sum(self.ops.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if name not in ALLOCATIONS and (func._schema.is_mutable or _new_memory(out, (args, kwargs))):
            self.ops[name] += 1
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _new_memory(out: Any, inputs: Any) -> bool:
    held = {t.untyped_storage().data_ptr() for t in _tensors(inputs)}
    return any(t.untyped_storage().data_ptr() not in held for t in _tensors(out))


class OneKernelAttention:
    """An attention backend double of one kernel: q's rows copied out as [T, Hq, D] (the shape and
    layout FlashInfer's run writes)."""

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: object, scale: float
    ) -> torch.Tensor:
        return q.transpose(0, 1).contiguous()  # [T, Hq, D]


class CausalAttention:
    """An attention backend double over the step's rows alone: causal, in torch's SDPA."""

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: object, scale: float
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)  # [T, Hq, D]


def _models(dtype: torch.dtype) -> tuple[Any, Any]:
    """The same random model (head dim 64, GQA) on torch's layers and on the stand-ins' FlashInfer layers."""
    hf = make_tiny_fa2_model(dtype=dtype)
    return native_from_hf(hf, TORCH_LAYERS), native_from_hf(hf, STANDIN)


def _layer_inputs(model: Any, rows: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    hidden = model.config.hidden_size
    x, residual = torch.randn(2, rows, hidden, generator=gen).to(dtype)
    positions = torch.randint(0, 500, (rows,), generator=gen)
    return x, residual, positions


def _count_layer(model: Any, dtype: torch.dtype, rows: int = 4) -> KernelCount:
    layer = model.layers[1]
    x, residual, positions = _layer_inputs(model, rows, dtype)
    meta = SimpleNamespace(backend=OneKernelAttention())
    with torch.inference_mode():
        rotary = model.rotary.for_step(positions, dtype)  # once per step, outside the layer
        with KernelCount() as count:
            layer.forward(x, residual, rotary, meta)
    return count


def test_a_torch_layer_dispatches_no_more_kernels_than_its_recorded_count():
    torch_model, _ = _models(torch.bfloat16)
    count = _count_layer(torch_model, torch.bfloat16)
    assert count.kernels <= TORCH_LAYER_KERNELS, f"the layer grew to {count.kernels} kernels: {dict(count.ops)}"
    assert count.kernels == TORCH_LAYER_KERNELS, f"fewer kernels ({count.kernels}): record the new count"


def test_the_flashinfer_layer_over_stand_ins_dispatches_one_kernel_per_fused_op():
    torch_model, fused_model = _models(torch.bfloat16)
    count = _count_layer(fused_model, torch.bfloat16)
    assert count.kernels == FLASHINFER_LAYER_KERNELS, dict(count.ops)
    assert count.kernels < _count_layer(torch_model, torch.bfloat16).kernels
    standin = {f"batchserve_standin.{op}.default": n for op, n in [("fused_add_rmsnorm", 2), ("rope", 1)]}
    assert {op: count.ops[op] for op in standin} == standin
    assert count.ops["batchserve_standin.silu_and_mul.default"] == 1
    assert count.ops["aten.linear.default"] == 4  # q|k|v and gate|up stay one product each


@pytest.mark.parametrize("rows", [1, 6])
def test_the_flashinfer_layer_over_stand_ins_computes_the_torch_layer(rows):
    torch_model, fused_model = _models(torch.float32)
    meta = SimpleNamespace(backend=CausalAttention())
    for index in (0, 1):  # the first layer (no residual yet) and one after it
        x, residual, positions = _layer_inputs(torch_model, rows, torch.float32, seed=rows + index)
        first = index == 0
        with torch.inference_mode():
            ref_out, ref_residual = torch_model.layers[index].forward(
                x, None if first else residual, torch_model.rotary.for_step(positions, torch.float32), meta
            )
            # The fused norms write in place: the layer gets copies, the inputs stay the torch layer's.
            ours, ours_residual = fused_model.layers[index].forward(
                x.clone(),
                None if first else residual.clone(),
                fused_model.rotary.for_step(positions, torch.float32),
                meta,
            )
        torch.testing.assert_close(ours, ref_out, rtol=1e-5, atol=1e-5)
        # The residual sum is the same float32 add on both paths.
        assert torch.equal(ours_residual, ref_residual)


def test_the_flashinfer_rotation_has_the_torch_rotations_bits_in_float32():
    gen = torch.Generator().manual_seed(3)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))  # head dim 64
    positions = torch.tensor([0, 5, 5, 6, 300, 7])
    hq, hkv, d = 3, 1, 64
    qkv = torch.randn(6, (hq + 2 * hkv) * d, generator=gen)
    for scaling in (1.0, 0.75):  # rope types that scale cos and sin (yarn's attention scaling)
        ref_q, ref_k, ref_v = Rotary(inv_freq, scaling).for_step(positions, torch.float32).split_heads(qkv, hq, hkv, d)
        rotary = FlashInferRotary(inv_freq, scaling, LIBRARY)
        q, k, v = rotary.for_step(positions, torch.float32).split_heads(qkv.clone(), hq, hkv, d)
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k) and torch.equal(v, ref_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_on_flashinfer_layers_over_stand_ins_gives_the_torch_models_logits(dtype):
    torch_model, fused_model = _models(dtype)
    meta = SimpleNamespace(backend=CausalAttention())
    gen = torch.Generator().manual_seed(4)
    rows = 9
    ids = torch.randint(0, torch_model.config.vocab_size, (1, rows), generator=gen)
    positions = torch.arange(rows)[None] + 40
    keep = torch.tensor([2, 5, 8])
    with torch.inference_mode():
        ref = torch_model(ids, positions, keep, meta).logits
        ours = fused_model(ids, positions, keep, meta).logits
    if dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    else:  # FlashInfer's kernels round once where torch's ops round between ops
        scale = ref.float().abs().max()
        assert (ours.float() - ref.float()).abs().max() < 0.05 * scale
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_the_layer_kernels_are_chosen_once_with_the_reason():
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    on_cpu = choose_layer_kernels(torch.device("cpu"), bf16, 64, 1536, load=lambda: LIBRARY)
    assert on_cpu.name == "torch" and "cpu" in on_cpu.why  # never FlashInfer's on the CPU, even where it imports

    def missing() -> Any:
        raise ImportError("No module named 'flashinfer'")

    assert "flashinfer does not import" in choose_layer_kernels(cuda, bf16, 64, 1536, load=missing).why
    assert "float32" in choose_layer_kernels(cuda, torch.float32, 64, 1536, load=lambda: LIBRARY).why
    assert "head dims" in choose_layer_kernels(cuda, bf16, 16, 1536, load=lambda: LIBRARY).why
    assert "16-byte" in choose_layer_kernels(cuda, bf16, 64, 1534, load=lambda: LIBRARY).why
    fused = choose_layer_kernels(cuda, bf16, 64, 1536, load=lambda: LIBRARY)
    assert fused.name == "flashinfer" and fused.library is LIBRARY


def test_a_model_shows_its_layer_kernels_as_classes_and_in_the_forward_record():
    torch_model, fused_model = _models(torch.float32)
    # Built on the CPU without a choice given: torch's layers, exactly these classes.
    cpu_model = native_from_hf(make_tiny_fa2_model(dtype=torch.float32))
    assert cpu_model.layer_kernels.name == "torch" and cpu_model.layer_kernels.device == "cpu"
    for model, (norm, act, rotary) in [
        (cpu_model, (RMSNorm, SiluAndMul, Rotary)),
        (torch_model, (RMSNorm, SiluAndMul, Rotary)),
        (fused_model, (FlashInferRMSNorm, FlashInferSiluAndMul, FlashInferRotary)),
    ]:
        layer = model.layers[0]
        assert type(layer.input_layernorm) is norm and type(layer.post_attention_layernorm) is norm
        assert type(model.norm) is norm and type(layer.mlp.act) is act and type(model.rotary) is rotary
    assert _fused_part(fused_model) == Part("flashinfer", STANDIN.why)
    assert _fused_part(cpu_model).choice == "off"  # the CPU's record as it was
    on_cuda = LayerKernels("torch", "torch's ops: flashinfer does not import (ImportError)", "cuda")
    assert _fused_part(SimpleNamespace(layer_kernels=on_cuda)) == Part("off", on_cuda.why)


def test_the_kernel_count_script_counts_each_path_apart_from_its_attention(monkeypatch):
    """scripts/count_kernels.py's counting (it runs on CUDA, in the GPU check) over a tiny bfloat16
    model on the CPU, each path's dispatched kernels standing in for CUDA's."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "scripts" / "count_kernels.py"
    spec = importlib.util.spec_from_file_location("count_kernels", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)

    def dispatched(run: Any, repeats: int) -> collections.Counter[str]:
        with KernelCount() as count:
            for i in range(repeats):
                run(i)
        return count.ops

    monkeypatch.setattr(script, "cuda_kernels", dispatched)
    torch_model, fused_model = _models(torch.bfloat16)
    for model, outside in [(torch_model, TORCH_LAYER_KERNELS - 1), (fused_model, FLASHINFER_LAYER_KERNELS - 1)]:
        counts = script.count_path(model, rows=4, repeats=3)
        (layer, copies), (attention, _) = counts["layer"], counts["attention"]
        assert layer - attention == outside and copies == 0
        assert f"{layer} CUDA kernels per decoder layer ({outside} outside attention" in script.line("x", counts, 1, 2)
