"""The host side of a step, measured alone: the engine driven by a stand-in forward that costs
nothing, so what is left of a step is schedule + prepare + verify + commit; and the same engine
on an emulated asynchronous device (`EmulatedDevice`), where the forward takes a GPU's time and
the pipelined loop builds one step's outputs while the next one's forward runs.

On a GPU the forward of a replayed step costs a few milliseconds; the host work around it then
decides the step's speed. A stand-in model that answers every kept row at once (no layers, no
attention) leaves exactly that work on the clock, on any machine. Its answer follows a bigram
table built from the prompts (the next token after a row's input is the one that followed it
last in the prompts), so outputs copy prompt text and the drafts are accepted as on real
copy-heavy workloads: the tree walks, compactions and trie updates all run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NamedTuple

import torch
from torch import nn

from batchserve.admission import Submission
from batchserve.attention.base import AttentionBackend, StepLayout
from batchserve.attention.flashinfer_backend import PagedPlan, build_plan
from batchserve.cost_profile import CostProfile
from batchserve.draft.base import LearnsLater
from batchserve.pipeline import StepPipeline
from batchserve.records import SchedulerOutput, StepPhases
from batchserve.request import SamplingParams

HOST_PHASES = ("schedule", "prepare", "verify", "commit")


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
        return build_plan(step, self.block_size)

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: Any, scale: float
    ) -> torch.Tensor:
        raise RuntimeError("the stand-in model computes no attention")

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        pass


class HostStats(NamedTuple):
    """Host milliseconds per step (medians over steps with every seat taken)."""

    requests: int  # requests in flight in the measured steps
    steps: int  # steps measured
    phase_ms: dict[str, float]  # median ms per step of each host phase
    host_ms: float  # median of schedule + prepare + verify + commit per step
    rows: float  # mean rows per step (roots, draft nodes)
    tokens_per_step: float  # mean tokens a request emitted per step


@dataclass(slots=True)
class _Steps:
    seats: int
    phases: list[StepPhases]
    rows: list[int]

    def add(self, out: SchedulerOutput, phases: StepPhases) -> None:
        # Full steps only, without a prompt chunk: the steady state a replayed step serves.
        if len(out.requests) == self.seats and all(len(r.token_ids) == 1 for r in out.requests):
            self.phases.append(phases)
            self.rows.append(out.num_tokens)


def measure_host(
    core: Any, prompts: Sequence[Sequence[int]], requests: int, max_new_tokens: int, decoding_length: int | None = None
) -> HostStats:
    """Run `prompts` through `core` (an EngineCore over a StandInModel) `requests` at a time, each
    to `max_new_tokens`, and report the host phases of the full steps."""
    seen = _Steps(requests, [], [])
    core.step_listeners.append(seen.add)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True, decoding_length=decoding_length)
    queue = list(prompts)
    emitted = 0
    try:
        while queue or core.has_work():
            while queue and len(core.scheduler.requests) < requests:
                core.add_request(Submission(list(queue.pop(0)), params))
            emitted += sum(len(o.new_token_ids) for o in core.step())
    finally:
        core.step_listeners.remove(seen.add)
    if not seen.phases:
        raise ValueError(f"no step ran {requests} requests at once: give at least {requests} prompts")
    phase_ms = {n: statistics.median(getattr(p, n) for p in seen.phases) * 1e3 for n in HOST_PHASES}
    host = statistics.median(sum(getattr(p, n) for n in HOST_PHASES) for p in seen.phases) * 1e3
    tokens = sum(p.tokens for p in seen.phases) / (len(seen.phases) * requests)
    return HostStats(requests, len(seen.phases), phase_ms, host, statistics.fmean(seen.rows), tokens)


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
    from batchserve.config import CacheConfig, DraftConfig, EngineConfig, ModelConfig, SchedulerConfig
    from batchserve.engine import EngineCore

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
    if isinstance(core.speculation.drafter, LearnsLater):  # as on a GPU: the trie's insertion beside the next forward
        core.speculation.drafter.defer_learning()
    return core


def time_host(
    prompts: Sequence[Sequence[int]], tokenizer: Any, vocab: int, points: Sequence[tuple[int, int]], max_new_tokens: int
) -> list[HostStats]:
    """HostStats at each (requests, decoding length) point, each on a fresh engine."""
    out = []
    for requests, length in points:
        core = stand_in_engine(prompts, tokenizer, vocab, requests, length)
        out.append(measure_host(core, prompts, requests, max_new_tokens))
    return out


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
    later), `collect` returns no earlier than the launch's end plus `profile`'s forward time for
    the step's rows, requests and context. Everything else is the wrapped runner's."""

    def __init__(self, runner: Any, profile: CostProfile) -> None:
        self.runner = runner
        self.profile = profile
        self._due = 0.0  # perf_counter() reading when the launched step's results are back
        self.device_seconds = 0.0  # the emulated forward time of every launched step

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def launch(self, out: SchedulerOutput) -> Any:
        launched = self.runner.launch(out)
        context = sum(r.num_computed_tokens + len(r.token_ids) for r in out.requests) / max(1, len(out.requests))
        seconds = self.profile.time_ms(out.num_tokens, context, len(out.requests)) / 1e3
        self.device_seconds += seconds
        self._due = time.perf_counter() + seconds
        return launched

    def collect(self, launched: Any) -> Any:
        wait = self._due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        return self.runner.collect(launched)

    def execute(self, out: SchedulerOutput) -> Any:
        return self.collect(self.launch(out))


class EmulatedStats(NamedTuple):
    """A run on the emulated device: what the host adds to its steps, and what comes out."""

    requests: int  # requests in flight at most
    pipelined: bool
    steps: int  # full steps measured (every seat taken, no prompt chunk)
    critical_ms: float  # median host ms a full step spends in series with the device
    outputs_ms: float  # median ms a full step spends building outputs (beside the forward when pipelined)
    device_ms: float  # mean emulated forward ms a step
    wall_ms: float  # mean wall ms a step, every step of the run
    tokens_per_s: float  # tokens emitted over the run's wall time
    tokens_per_step: float  # mean tokens a request emitted per full step
    draft_rows: float  # mean draft rows a full step


def measure_emulated(
    core: Any, prompts: Sequence[Sequence[int]], requests: int, max_new_tokens: int, pipelined: bool
) -> EmulatedStats:
    """Run `prompts` through `core` (its runner an EmulatedDevice) `requests` at a time, with the
    pipelined loop or the sequential one. A full step's critical path is schedule + prepare +
    verify + commit, and building its outputs too where the loop is sequential."""
    device = core.runner
    seen = _Steps(requests, [], [])
    core.step_listeners.append(seen.add)
    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    queue, pipe = list(prompts), StepPipeline(core)
    emitted = steps = 0
    start = time.perf_counter()
    try:
        while queue or pipe.has_work():
            while queue and len(core.scheduler.requests) < requests:
                core.add_request(Submission(list(queue.pop(0)), params))
            outs = pipe.step() if pipelined else core.step()
            emitted += sum(len(o.new_token_ids) for o in outs)
            steps += 1
    finally:
        core.step_listeners.remove(seen.add)
    wall = time.perf_counter() - start
    if not seen.phases:
        raise ValueError(f"no step ran {requests} requests at once: give at least {requests} prompts")
    host = [*HOST_PHASES] if pipelined else [*HOST_PHASES, "outputs"]
    critical = statistics.median(sum(getattr(p, n) for n in host) for p in seen.phases) * 1e3
    outputs = statistics.median(p.outputs for p in seen.phases) * 1e3
    tokens = sum(p.tokens for p in seen.phases) / (len(seen.phases) * requests)
    drafts = statistics.fmean(seen.rows) - requests
    num_steps = core.num_steps or 1
    return EmulatedStats(
        requests, pipelined, len(seen.phases), critical, outputs, device.device_seconds * 1e3 / num_steps,
        wall * 1e3 / max(1, steps), emitted / wall, tokens, drafts,
    )  # fmt: skip


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
