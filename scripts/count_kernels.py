"""CUDA kernels per decoder layer of the native forward, on torch's layer ops and on FlashInfer's
fused ones (issue 77: the graph-replayed bf16 step is launch-bound): SmolLM2-135M's shape with
random weights, bfloat16, a decode-like step (one row per request, at scattered positions), one
layer after the first counted under torch.profiler; then each path's whole step captured in a CUDA
graph and replayed, timed. Attention is a stand-in on both paths (torch's SDPA over the step's own
rows: no paged KV, so no FlashInfer prefill module to build), counted apart.

Run from the repository root on a CUDA machine with the project importable (the GPU check's step):
    python scripts/count_kernels.py [--rows 4] [--layers 30] [--repeats 5] [--serial-build]
One line per path, `<path> path: N CUDA kernels per decoder layer (M outside attention, ...)`,
then the kernel names of one layer per path, and the two paths' logits compared. (On the CPU the
same layers dispatch 28 ops outside attention on torch's path and 8 on FlashInfer's, stand-ins
counted as one: tests/model/test_layer_kernels.py; a CUDA op may launch more than one kernel.)
Exit status 1 where the FlashInfer path cannot run (its line says why: flashinfer does not import,
...). FlashInfer's norm, activation and rope modules are built with nvcc on first use (in
parallel, the seconds printed) unless ~/.cache/flashinfer holds them; the rest takes seconds.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from batchserve.model import native_from_hf
from batchserve.model.layer_kernels import LayerKernels, choose_layer_kernels, load_flashinfer

# SmolLM2-135M's config (the default model's).
SMOLLM2 = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)
DTYPE = torch.bfloat16


class CausalAttention:
    """The attention stand-in of both paths: causal SDPA over the step's own rows, [heads, T, D]
    in and [T, Hq, D] out (the backends' layout), contiguous as FlashInfer's is (so the layer's
    o_proj reads it as it is: no copy outside attention)."""

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: object, scale: float
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1).contiguous()  # [T, Hq, D]


def hf_model(layers: int, device: str) -> Any:
    """SmolLM2-shaped random Llama with `layers` layers, in bfloat16 on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SMOLLM2, num_hidden_layers=layers, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it runs: seconds less than on the CPU
        return LlamaForCausalLM(config).to(DTYPE).eval()


def warm_flashinfer(library: Any, device: str, parallel: bool = True) -> float:
    """Run each FlashInfer op the layers call once, the three modules at once unless not `parallel`
    (their first use builds them with nvcc): the seconds it took."""
    t0 = time.perf_counter()
    x = torch.randn(2, 64, device=device, dtype=DTYPE)
    w = torch.ones(64, device=device, dtype=DTYPE)
    qk = torch.randn(2, 2 * 64, device=device, dtype=DTYPE)
    cos_sin = torch.ones(8, 64, device=device)
    pos = torch.zeros(2, dtype=torch.int64, device=device)
    calls: list[Callable[[], Any]] = [
        lambda: (library.norm.rmsnorm(x, w, 1e-5), library.norm.fused_add_rmsnorm(x.clone(), x.clone(), w, 1e-5)),
        lambda: library.activation.silu_and_mul(torch.cat((x, x), dim=-1)),
        lambda: library.rope.apply_rope_with_cos_sin_cache_inplace(pos, qk[:, :64], qk[:, 64:], 64, cos_sin, True),
    ]
    if parallel:
        with ThreadPoolExecutor(len(calls)) as pool:
            for future in [pool.submit(call) for call in calls]:
                future.result()
    else:
        for call in calls:
            call()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def is_copy(name: str) -> bool:
    return name.startswith(("Memcpy", "Memset"))


def cuda_kernels(run: Callable[[int], Any], repeats: int) -> collections.Counter[str]:
    """The CUDA kernels (and copies) `run(i)` for i in range(repeats) launches, by name."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(repeats):
            run(i)
        torch.cuda.synchronize()
    events = prof.events()
    names = collections.Counter(e.name for e in events if e.device_type == DeviceType.CUDA)
    if not names:  # older profilers list a CPU op's kernels under it instead
        names = collections.Counter(k.name for e in events for k in getattr(e, "kernels", []))
    return names


def per_call(names: collections.Counter[str], repeats: int) -> tuple[int, int]:
    """(kernels, copies) per call, from `repeats` calls' counts."""
    kernels = sum(n for name, n in names.items() if not is_copy(name))
    copies = sum(n for name, n in names.items() if is_copy(name))
    return kernels // repeats, copies // repeats


def layer_step(model: Any, rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode-like step's layer inputs: x and residual [rows, H] bfloat16, positions [rows]
    (one row per request, each at its own position)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    device = next(model.parameters()).device
    x, residual = (torch.randn(2, rows, model.config.hidden_size, generator=gen) * 0.5).to(device, DTYPE)
    positions = torch.randint(0, 2000, (rows,), generator=gen).to(device)
    return x, residual, positions


def count_path(model: Any, rows: int, repeats: int) -> dict[str, Any]:
    """Kernels of one decoder layer after the first (the residual add inside its norms), of the
    attention stand-in alone (with this path's q, k and v layouts), and of a whole step."""
    layer, meta = model.layers[1], SimpleNamespace(backend=CausalAttention())
    attn = layer.self_attn
    x, residual, positions = layer_step(model, rows, seed=1)
    with torch.inference_mode():
        rotary = model.rotary.for_step(positions, DTYPE)
        # FlashInfer's norms write in place: every call gets its own copies, made before counting.
        inputs = [(x.clone(), residual.clone()) for _ in range(repeats + 1)]
        layer.forward(*inputs[-1], rotary, meta)  # lazy inits (cuBLAS handles, ...) outside the count
        layer_names = cuda_kernels(lambda i: layer.forward(*inputs[i], rotary, meta), repeats)
        qkv = attn.qkv_proj.forward(x)
        heads = [rotary.split_heads(qkv.clone(), attn.num_heads, attn.num_kv_heads, attn.head_dim) for _ in range(2)]
        attn_names = cuda_kernels(lambda i: meta.backend.forward(1, *heads[i], meta, attn.scaling), 1)
        ids = torch.randint(0, model.config.vocab_size, (1, rows), device=x.device)
        pos, keep = positions[None], torch.arange(rows, device=x.device)
        model(ids, pos, keep, meta)
        step_names = cuda_kernels(lambda i: model(ids, pos, keep, meta), 1)
    return {
        "layer": per_call(layer_names, repeats),
        "attention": per_call(attn_names, 1),
        "step": per_call(step_names, 1),
        "names": {name: n // repeats for name, n in layer_names.most_common()},
    }


def replay_ms(model: Any, rows: int, replays: int = 200) -> tuple[float, torch.Tensor]:
    """Milliseconds per step of the whole forward captured in a CUDA graph and replayed, and the
    step's logits [rows, V]."""
    meta = SimpleNamespace(backend=CausalAttention())
    device = next(model.parameters()).device
    _, _, positions = layer_step(model, rows, seed=2)
    gen = torch.Generator(device="cpu").manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (1, rows), generator=gen).to(device)
    pos, keep = positions[None].clone(), torch.arange(rows, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(2):
            model(ids, pos, keep, meta)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        logits = model(ids, pos, keep, meta).logits[0]
    for _ in range(20):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays, logits.float().clone()


def line(name: str, counts: dict[str, Any], ms: float, layers: int) -> str:
    (layer, layer_copies), (attention, _), (step, _) = counts["layer"], counts["attention"], counts["step"]
    copies = f", {layer_copies} copies" if layer_copies else ""
    return (
        f"{name} path: {layer} CUDA kernels per decoder layer ({layer - attention} outside attention,"
        f" {attention} attention{copies}); {step} a whole step of {layers} layers; {ms:.3f} ms a step replayed"
        " from a CUDA graph"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4, help="the step's rows, one per request (decode)")
    parser.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M: 30)")
    parser.add_argument("--repeats", type=int, default=5, help="layer calls counted (the count is per call)")
    parser.add_argument("--serial-build", action="store_true", help="build FlashInfer's modules one after another")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("count_kernels: needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    device = "cuda"
    hf = hf_model(args.layers, device)
    config = hf.config
    chosen = choose_layer_kernels(torch.device(device), DTYPE, config.head_dim, config.intermediate_size)
    paths: list[tuple[str, LayerKernels]] = [("torch", LayerKernels("torch", "torch's ops (asked for)", device))]
    if chosen.name == "flashinfer":
        seconds = warm_flashinfer(load_flashinfer(), device, parallel=not args.serial_build)
        print(f"flashinfer norm, activation and rope modules ready in {seconds:.1f} s", flush=True)
        paths.append(("flashinfer", chosen))
    results: dict[str, tuple[dict[str, Any], float, torch.Tensor]] = {}
    for name, kernels in paths:
        model = native_from_hf(hf, kernels)
        counts = count_path(model, args.rows, args.repeats)
        ms, logits = replay_ms(model, args.rows)
        results[name] = (counts, ms, logits)
        print(line(name, counts, ms, args.layers), flush=True)
        del model
    if chosen.name != "flashinfer":
        print(f"flashinfer path: not run: {chosen.why}", flush=True)
    for name, (counts, _, _) in results.items():
        print(f"{name} layer kernels: " + ", ".join(f"{n} x {k[:60]}" for k, n in counts["names"].items()))
    if len(results) == 2:
        ref, ours = results["torch"][2], results["flashinfer"][2]
        diff = (ours - ref).abs().max().item() / max(ref.abs().max().item(), 1e-9)
        agree = (ours.argmax(-1) == ref.argmax(-1)).sum().item()
        print(f"flashinfer vs torch logits: max |diff| {diff:.4f} of max |logit|, argmax agrees on {agree}/{args.rows}")
    print(f"count_kernels: {time.perf_counter() - t0:.1f} s", flush=True)
    return 0 if chosen.name == "flashinfer" else 1


if __name__ == "__main__":
    sys.exit(main())
