"""Does compiling the forward on CPU speed up the engine's step? Eager vs torch.compile variants.

    TORCHINDUCTOR_CACHE_DIR=/tmp/compile_out/cache python benchmarks/compile_forward.py \
        --variants eager,mlp,layer,layer-freeze,mkldnn --repeats 15 --generate

Variants (all share one model's weights; they are swapped in round-robin so drift on a shared
machine spreads over all of them):
  eager         the engine as it is
  mlp           torch.compile(dynamic=True) of every layer's MLP; attention and norms eager
  layer         torch.compile(dynamic=True) of every decoder layer, with the attention hook
                wrapped in torch.compiler.disable (one graph break per layer)
  layer-freeze  as `layer`, with inductor freezing (weights become constants, prepacked GEMMs)
  mkldnn        no compile: every nn.Linear (and the LM head) calls oneDNN's linear directly

Each step is a real `ModelRunner.execute` of a synthetic step built like `batchserve calibrate`
builds them (context 256 per request). "first call" is the step's first execute with that
variant minus the eager step time: the compile cost a server start would pay for that shape.
Run twice with the same TORCHINDUCTOR_CACHE_DIR to see the cost with a warm on-disk cache.
Losslessness: every kept row's argmax must equal eager's; with --generate, each variant's
greedy `LLM(draft="none")` output must equal HF `generate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from batchserve.attention import TorchReferenceBackend
from batchserve.runner import ModelRunner, load_model
from batchserve.runner.calibrate import _step, lower_quartile
from batchserve.runner.runner import ATTN_IMPL, _attention

# name -> (contexts of the requests, rows in all): rows are split evenly over the requests.
SHAPES: dict[str, tuple[list[int], int]] = {
    "1 (1 req decode)": ([256], 1),
    "8 (8 reqs decode)": ([256] * 8, 8),
    "8 (1 req + 7 draft)": ([256], 8),
    "32 (16 reqs x 2)": ([256] * 16, 32),
    "128 (16 reqs x 8)": ([256] * 16, 128),
    "128 (1 prompt chunk)": ([256], 128),
}
PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea.", "import numpy as np\n"]


class Capture:
    """Stands in for the model inside the runner and keeps the last step's logits."""

    def __init__(self, model: Any) -> None:
        self.model, self.logits = model, torch.empty(0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, **kwargs: Any) -> Any:
        out = self.model(**kwargs)
        self.logits = out.logits[0].clone()
        return out


def _mkldnn_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class Variants:
    """Builds the variants on one model and switches between them."""

    def __init__(self, model: Any, names: list[str]) -> None:
        from transformers import AttentionInterface

        self.model, self.register = model, AttentionInterface.register
        self.disabled_attention = torch.compiler.disable(_attention)
        base = model.model.layers
        self.layers: dict[str, torch.nn.ModuleList] = {"eager": base, "mkldnn": base}
        for name in names:
            if name == "mlp":
                for layer in base:  # compiled MLPs live inside copies of the layer list
                    layer._compiled_mlp = torch.compile(layer.mlp, dynamic=True)
                self.layers[name] = base
            elif name.startswith("layer"):
                opts = {"freezing": True} if name == "layer-freeze" else None
                self.layers[name] = torch.nn.ModuleList(torch.compile(x, dynamic=True, options=opts) for x in base)
        self.linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        self.mlps = {layer: layer.mlp for layer in base}

    def use(self, name: str) -> None:
        self.model.model.layers = self.layers[name]
        attention = self.disabled_attention if name.startswith("layer") else _attention
        self.register(ATTN_IMPL, attention)
        for layer, mlp in self.mlps.items():
            layer.mlp = layer._compiled_mlp if name == "mlp" else mlp
        for lin in self.linears:
            if name == "mkldnn":
                lin.forward = types.MethodType(_mkldnn_forward, lin)
            else:
                lin.__dict__.pop("forward", None)


def _ms(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def bench_steps(model: Any, variants: Variants, names: list[str], repeats: int) -> None:
    c = model.config
    head_dim = c.hidden_size // c.num_attention_heads
    backend = TorchReferenceBackend(c.num_hidden_layers, 1024, 16, c.num_key_value_heads, head_dim)
    torch.manual_seed(0)
    backend.k_cache.normal_()  # a context that is not all zeros
    backend.v_cache.normal_()
    runner = ModelRunner(model, backend, cpu_linear="torch")  # the variants choose the linear kernel
    cap = Capture(model)
    runner.model = cap
    steps, offset = {}, 0
    for label, (ctxs, rows) in SHAPES.items():  # disjoint blocks per shape: steps stay repeatable
        out = _step(runner, ctxs, rows)
        reqs = tuple(dataclasses.replace(r, block_ids=tuple(b + offset for b in r.block_ids)) for r in out.requests)
        offset = max(b for r in reqs for b in r.block_ids) + 1
        steps[label] = dataclasses.replace(out, requests=reqs)
    variants.use("eager")
    eager_ms, ref = {}, {}
    for label, out in steps.items():
        runner.execute(out)
        eager_ms[label] = min(_ms(lambda out=out: runner.execute(out)) for _ in range(3))
        ref[label] = cap.logits
    print("first call (compile) per variant and shape, minus the eager step time:")
    checks: dict[tuple[str, str], str] = {}
    for name in names[1:]:
        variants.use(name)
        total = 0.0
        for label, out in steps.items():
            first = _ms(lambda out=out: runner.execute(out)) - eager_ms[label]
            total += max(first, 0.0)
            same = bool((cap.logits.argmax(-1) == ref[label].argmax(-1)).all())
            diff = (cap.logits - ref[label]).abs().max().item()
            checks[name, label] = f"argmax {'same' if same else 'DIFFERENT'}, max|dlogit| {diff:.1e}"
            print(f"  {name:13s} {label:22s} {first / 1e3:7.2f} s", flush=True)
        print(f"  {name:13s} {'all shapes':22s} {total / 1e3:7.2f} s", flush=True)
    times: dict[tuple[str, str], list[float]] = {(n, s): [] for n in names for s in steps}
    for _ in range(repeats):  # round-robin: every variant at every shape once per repeat
        for label, out in steps.items():
            for name in names:
                variants.use(name)
                times[name, label].append(_ms(lambda out=out: runner.execute(out)))
    variants.use("eager")
    print(f"\nstep ms (lower quartile of {repeats}), speedup vs eager:")
    print(f"{'rows':22s}" + "".join(f"{n:>22s}" for n in names))
    for label in steps:
        base = lower_quartile(times["eager", label])
        lq = [lower_quartile(times[n, label]) for n in names]
        cells = [f"{t:9.1f} ({base / t:4.2f}x)" for t in lq]
        print(f"{label:22s}" + "".join(f"{x:>22s}" for x in cells))
    print("\nlogits vs eager:")
    for (name, label), msg in checks.items():
        print(f"  {name:13s} {label:22s} {msg}")


def check_generate(model: Any, tok: Any, variants: Variants, names: list[str], reference: list[list[int]]) -> None:
    from batchserve import LLM, SamplingParams

    llm = LLM(draft="none", adaptive=False, hf_model=model, tokenizer=tok, kv_cache_memory_gb=0.25)
    params = SamplingParams(max_new_tokens=32)
    print("\ngreedy LLM(draft='none') vs HF generate, 4 prompts x 32 tokens:")
    for name in names:
        variants.use(name)  # after LLM(): it registered the plain attention hook
        got = [r.token_ids for r in llm.generate(PROMPTS, params)]
        print(f"  {name:13s} {'identical' if got == reference else 'DIFFERENT: ' + repr(got)}")
    variants.use("eager")


def hf_reference(model: Any, tok: Any) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        x = torch.tensor([tok(p).input_ids])
        with torch.no_grad():
            y = model.generate(
                x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=32, pad_token_id=tok.eos_token_id
            )
        out.append(y[0, x.shape[1] :].tolist())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="eager,mlp,layer,layer-freeze,mkldnn")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--generate", action="store_true", help="also compare greedy output with HF generate")
    args = ap.parse_args()
    names = ["eager", *(n for n in args.variants.split(",") if n != "eager")]
    torch._dynamo.config.cache_size_limit = 256  # frozen weights: one graph per layer
    torch._dynamo.config.accumulated_cache_size_limit = 1024
    model, tok = load_model(None, "float32")
    reference = hf_reference(model, tok) if args.generate else []
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()}")
    t0 = time.perf_counter()
    variants = Variants(model, names)
    print(f"wrapping modules: {time.perf_counter() - t0:.2f} s (compiles happen at first call)")
    bench_steps(model, variants, names, args.repeats)
    print(f"load average {os.getloadavg()}")
    if args.generate:
        check_generate(model, tok, variants, names, reference)


if __name__ == "__main__":
    main()
