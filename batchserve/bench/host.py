"""The engine below its public API: one of the bench's two modules that reach past it
(`bench/__init__.py` names them; `simulate.py` is the other, for the drafters).

The host-side stand-in. On a GPU the forward of a replayed step costs a few milliseconds; the host
work around it then decides the step's speed. A stand-in model that answers every kept row at
once (no layers, no attention) leaves exactly that work on the clock, on any machine: the engine
built over it (`stand_in_engine`) is measured by `host_timing.py`. Its answer follows a bigram
table built from the prompts (the next token after a row's input is the one that followed it
last in the prompts), so outputs copy prompt text and the drafts are accepted as on real
copy-heavy workloads: the tree walks, compactions and trie updates all run. The same engine runs
on an emulated asynchronous device (`EmulatedDevice`), where the forward takes a GPU's time, and
in the loop that serves on a device (`pipeline`: `serving_loop.StepPipeline`), which builds one
step's outputs while the next forward runs.

The model side the public API does not give (each a handle the bench would take from `LLM` or
`EngineCore` if they offered it): a forward built once and handed to many engines
(`build_forward`), the CPU weights `batchserve serve` takes here (`served_weights`), the ids an
engine stops at (`stop_ids`), a step cost curve measured on an engine's own runner
(`measure_curve`), and a native model built from a transformers one (`native_model`,
`packed_modules`: `bench --shape`'s random weights).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from batchserve.attention.base import AttentionBackend, StepLayout
from batchserve.attention.flashinfer_backend import PagedPlan, build_plan
from batchserve.cost_profile import CostProfile
from batchserve.records import SchedulerOutput
from batchserve.serving_loop import StepPipeline


class StandInModel(nn.Module):
    """A model with the runner's interface whose forward does no model work: the logits of every
    kept row are one-hot at `successor[input token]`, except that at one (position, token) pair in
    `break_every` (a fixed hash) the text jumps to another token of `jumps` (the prompts' tokens): a
    draft copying the text misses there, as a real model's answers leave the text they copy now and
    then, and copying resumes from the new place. One layer's worth of shape facts (a small KV pool)."""

    native = True  # the runner calls it directly, with the step's attention metadata
    cpu_weights = "-"

    def __init__(
        self,
        successor: torch.Tensor,
        jumps: torch.Tensor,
        break_every: int = 3,
        num_kv_heads: int = 1,
        head_dim: int = 16,
    ) -> None:
        super().__init__()
        self.break_every = break_every
        self.register_buffer("jumps", jumps.long())  # [J] where the text may jump to
        vocab = len(successor)
        self.register_buffer("successor", successor.long())  # [V]
        self.anchor = nn.Parameter(torch.zeros(1), requires_grad=False)  # the device and dtype the runner reads
        self.config = SimpleNamespace(
            model_type="llama",
            vocab_size=vocab,
            hidden_size=num_kv_heads * head_dim,
            num_attention_heads=num_kv_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            num_hidden_layers=1,
            max_position_embeddings=1 << 16,
            eos_token_id=None,
        )
        self.generation_config = None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logits_to_keep: torch.Tensor,
        attn_metadata: Any,
        use_cache: bool = False,
    ) -> SimpleNamespace:
        kept = input_ids[0, logits_to_keep]  # [K]
        pos = position_ids[0, logits_to_keep]  # [K]
        nxt = self.successor[kept]  # [K]
        h = pos * 7919 + kept * 104729  # [K] a fixed hash of (position, token)
        nxt = torch.where(h % self.break_every == 0, self.jumps[(h // self.break_every) % len(self.jumps)], nxt)
        logits = torch.zeros(len(kept), self.config.vocab_size)  # [K, V]
        logits[torch.arange(len(kept)), nxt] = 1.0
        return SimpleNamespace(logits=logits[None])  # [1, K, V]


def bigram_successor(prompts: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """[V] the token that last followed each token in `prompts`; t + 1 for tokens never followed."""
    successor = (torch.arange(vocab) + 1) % vocab
    for ids in prompts:
        if len(ids) > 1:
            successor[torch.tensor(ids[:-1])] = torch.tensor(ids[1:])
    return successor


class PlanOnlyBackend(AttentionBackend):
    """The host's share of a GPU step's attention: the step planned into FlashInfer's page table
    and mask arrays (`build_plan`, what the GPU backend hands its planner), with no pool and no
    kernel. The stand-in model never calls `forward`; compaction is device work (a no-op here)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size

    def build_metadata(self, step: StepLayout, slot_mapping: torch.Tensor) -> PagedPlan:
        return build_plan(step, self.block_size, masked=not step.causal)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any, scale: float
    ) -> torch.Tensor:
        raise RuntimeError("the stand-in model computes no attention")

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        pass


def stand_in_engine(
    prompts: Sequence[Sequence[int]],
    tokenizer: Any,
    vocab: int,
    seats: int,
    decoding_length: int,
    adaptive_profile: CostProfile | None = None,
) -> Any:
    """An EngineCore over a StandInModel (trie drafts, fixed decoding length, a pool for `seats`),
    its steps bucketed as for CUDA graphs and planned as for FlashInfer (`PlanOnlyBackend`).
    `adaptive_profile`: the adaptive draft length instead, planned with this profile."""
    from batchserve import EngineCore
    from batchserve.config import CacheConfig, DraftConfig, EngineConfig, ModelConfig, SchedulerConfig

    config = EngineConfig(
        # The bucketed steps a GPU replays: padding, staging and planning are host work too.
        model=ModelConfig(attention_backend="torch", cuda_graphs="eager"),
        cache=CacheConfig(block_size=16, num_blocks=max(256, seats * 96)),
        scheduler=SchedulerConfig(max_num_seqs=seats, max_num_batched_tokens=max(512, seats * (decoding_length + 1))),
        draft=DraftConfig(decoding_length=decoding_length, adaptive=adaptive_profile is not None),
    )
    jumps = torch.tensor([t for ids in prompts for t in ids])
    model = StandInModel(bigram_successor(prompts, vocab), jumps)
    core = EngineCore(config, model, tokenizer, cost_profile=adaptive_profile)
    core.runner.backend = PlanOnlyBackend(config.cache.num_blocks + 2, config.cache.block_size)
    if core.runner.graphs is not None:
        core.runner.graphs.backend = core.runner.backend
    drafter = core.speculation.drafter
    if hasattr(drafter, "defer_learning"):  # as on a GPU: the trie's insertion beside the next forward
        drafter.defer_learning()
    return core


# SmolLM2-135M bf16 replayed from CUDA graphs on one H100: the engine's start-up profile (one
# request, 512 keys; benchmarks/results/gpu-graphs/bench-run2.md), the forward an emulated device takes.
H100_SMOLLM2 = CostProfile(
    "h100-smollm2-bf16-graphs",
    (1, 2, 4, 8, 12, 16, 24, 32, 48, 64),
    (512,),
    ((3.64, 4.28, 4.20, 4.66, 4.55, 4.55, 4.76, 4.71, 4.79, 4.88),),
)


class EmulatedDevice:
    """A runner whose forward runs asynchronously and takes a device's time: `launch` does the
    host's work and returns (the stand-in's logits are ready at once, as queued kernels would be
    later), `collect` waits (spinning) until the step's staging ended plus `profile`'s forward
    time for the step's rows, requests and context. Everything else is the wrapped runner's."""

    def __init__(self, runner: Any, profile: CostProfile) -> None:
        self.runner = runner
        self.profile = profile
        self._due = 0.0  # perf_counter() reading when the launched step's results are back
        self.device_seconds = 0.0  # the emulated forward time of every launched step

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def launch(self, out: SchedulerOutput) -> Any:
        start = time.perf_counter()
        launched = self.runner.launch(out)
        context = sum(r.num_computed_tokens + len(r.token_ids) for r in out.requests) / max(1, len(out.requests))
        seconds = self.profile.time_ms(out.num_tokens, context, len(out.requests)) / 1e3
        self.device_seconds += seconds
        # The device starts once the host has staged the step: the stand-in's forward, choice and
        # acceptance, which ran here on the CPU, are the device's work, inside its time, as the
        # queued kernels' are on a GPU (not host time added to it).
        self._due = start + launched.clock.spent["prepare"] + seconds
        return launched

    def collect(self, launched: Any) -> Any:
        # Spin, as the runner's readback does on CUDA (an event without the blocking-sync flag:
        # the driver spins while the process has fewer contexts than cores): a core that slept
        # through the forward wakes slow, and the host work after it measured 3x its cost.
        while time.perf_counter() < self._due:
            pass
        return self.runner.collect(launched)

    def execute(self, out: SchedulerOutput) -> Any:
        return self.collect(self.launch(out))


def emulated_engine(
    prompts: Sequence[Sequence[int]],
    tokenizer: Any,
    vocab: int,
    seats: int,
    decoding_length: int,
    profile: CostProfile = H100_SMOLLM2,
    adaptive: bool = False,
) -> Any:
    """`stand_in_engine` on an emulated device whose forward costs what `profile` says; with
    `adaptive`, the draft length is the policy's, planned with that same profile."""
    core = stand_in_engine(prompts, tokenizer, vocab, seats, decoding_length, profile if adaptive else None)
    core.runner = EmulatedDevice(core.runner, profile)
    return core


def seated(core: Any) -> int:
    """Requests in `core`'s scheduler (waiting or running): a closed loop adds one while fewer
    than its seats are."""
    return len(core.scheduler.requests)


def device_seconds(core: Any) -> float:
    """The emulated forward time of every step `core` launched on its `EmulatedDevice`."""
    return core.runner.device_seconds


def pipeline(core: Any) -> Any:
    """The pipelined loop over `core` (`StepPipeline`: a step's outputs built beside the next
    forward), as the serving loop runs it on a device."""
    return StepPipeline(core)


def build_forward(model: Any, impl: str, cpu_linear: str, cpu_weights: str) -> Any:
    """What an engine with these settings runs over `model` (transformers', as loaded), built
    once: `LLM(hf_model=...)` takes a built forward back as it is, so many engines share one.
    `gguf` reads the file the model came from again, from its blocks, as the server does."""
    from batchserve.model import choose_impl

    return choose_impl(model, impl, cpu_linear, cpu_weights)


def served_weights(on_cpu: bool, model_path: str | None) -> tuple[str, str]:
    """(the CPU weights `cpu_weights=auto` takes for `batchserve serve` of the model at
    `model_path` here, why): known before any model loads. The bench's in-process engines run
    the same (`gguf`: the file read from its blocks, not transformers' copy: `build_forward`)."""
    from batchserve.model import cpu_weights_choice

    choice = cpu_weights_choice(on_cpu, model_path)
    return choice.weights, choice.why


def stop_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    """The token ids an engine over `model` ends a request at (its end-of-sequence ids)."""
    from batchserve.runner.build import eos_token_ids

    return eos_token_ids(model, tokenizer)


def measure_curve(
    llm: Any, rows: tuple[int, ...], contexts: tuple[int, ...], repeats: int, progress: bool = True
) -> dict[str, Any]:
    """curve.json's measurements on `llm`'s idle engine, by the engine's own calibration
    (`runner/calibrate.py`) on its own runner: the cost profile at `contexts`, and at each context
    the decode steps of n requests of one row each, n in `rows`."""
    from dataclasses import asdict

    from batchserve.runner.calibrate import calibrate, curve_of, step_of

    runner = llm.engine.runner
    profile = calibrate(
        runner,
        max_tokens=max(rows),
        max_context=llm.engine.facts.max_model_len,
        contexts=contexts,
        repeats=repeats,
        progress=progress,
        token_counts=rows,
    )
    decode: dict[str, list[float]] = {}
    try:
        for ctx in profile.contexts:  # those that fit the model and the pool
            steps = [step_of(runner, [ctx] * n, n) for n in rows]  # n requests, one row each
            decode[str(ctx)] = [round(ms, 4) for ms in curve_of(runner, steps, repeats, lambda: None)]
    finally:
        runner.release([f"calibrate-{i}" for i in range(max(rows))])
    return {"rows": list(rows), "contexts": list(profile.contexts), "decode_ms": decode, "profile": asdict(profile)}


def native_model(hf: Any) -> nn.Module:
    """The engine's native forward (`model/llama.py`) over a transformers Llama's weights, built as
    the engine builds any Llama it serves (`native_from_hf`), its layers left as built."""
    from batchserve.model import native_from_hf

    return native_from_hf(hf)


def packed_modules() -> dict[str, tuple[str, int]]:
    """transformers' projection -> (the native model's merged product, its part): q|k|v, gate|up."""
    from batchserve.model.llama import PACKED_MODULES

    return PACKED_MODULES
