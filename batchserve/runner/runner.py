"""Runs one engine step: pack the scheduled requests into one ragged forward, verify, sample."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from batchserve.attention.base import AttentionBackend
from batchserve.records import RunnerOutput, ScheduledRequest, SchedulerOutput, StepPhases
from batchserve.request import SamplingParams
from batchserve.runner.batch import BlockTables, PackedStep, pack
from batchserve.runner.clock import PhaseClock
from batchserve.runner.cpu_linear import use_onednn_linear
from batchserve.runner.graphs import StepGraphs
from batchserve.runner.hf_attention import ATTN_IMPL, register_attention, unserved_attention
from batchserve.runner.penalties import LogprobsAsk, penalize, prompt_logprobs, requests_logprobs
from batchserve.runner.sampler import (
    SampledRows,
    TreeRows,
    Verdict,
    accept,
    accepted_path,
    apply_token_masks,
    choose_on_device,
)
from batchserve.runner.staging import Readback, Upload

logger = logging.getLogger("batchserve")
PROBE_ID = "#device-probe"  # outside request ids' alphabet: no request can share its runner state
UNIFORM_CHUNK = 64  # uniforms drawn at a time from a sampling request's generator


def _slots(block_tables: np.ndarray, kv_index: np.ndarray, block_size: int) -> np.ndarray:
    """[M] pool slots of KV indices [M], each in its own block table [M, W]."""
    blocks = np.take_along_axis(block_tables, (kv_index // block_size)[:, None], axis=1)[:, 0]
    return blocks * block_size + kv_index % block_size


@dataclass(slots=True)
class LaunchedStep:
    """A step between `launch` and `collect`: what verification on the host still needs."""

    out: SchedulerOutput
    step: PackedStep
    sampling: list[tuple[int, ScheduledRequest]]  # (index in the step, request) of the sampling requests
    raw: tuple[torch.Tensor, dict[str, int]] | None  # raw logits of the requests asking for logprobs
    scored: torch.Tensor  # [N, V] prompt scoring's rows
    verdict: tuple[torch.Tensor, Any] | None  # `accept`'s result on its way to the host (None: none sampled)
    clock: PhaseClock


class ModelRunner:
    """Owns the model, the attention backend (and with it the KV pool) and per-request RNGs.

    Runs in the engine's worker thread; everything it reads per step comes in the
    SchedulerOutput. What it keeps between steps: the backend's KV pool, the block tables' array,
    the staging buffers, the captured graphs, and each sampling request's generator and the
    uniforms drawn from it but not yet used.
    """

    def __init__(
        self, model: Any, backend: AttentionBackend, cpu_linear: str = "auto", graphs: StepGraphs | None = None
    ) -> None:
        if not getattr(model, "native", False):  # the native model calls the backend itself
            why = unserved_attention(model)
            if why is not None:
                model_type = getattr(getattr(model, "config", None), "model_type", "this model")
                raise ValueError(f"{model_type} is not served: {why}")
            register_attention()
            model.set_attn_implementation(ATTN_IMPL)
        self.onednn_linear = use_onednn_linear(model, cpu_linear)
        self.model = model
        self.backend = backend
        self.device = next(model.parameters()).device
        self._generators: dict[str, torch.Generator] = {}
        self._uniforms: dict[str, list[float]] = {}  # drawn but not yet used, per sampling request
        self._tables = BlockTables()
        # What each step copies to the device, one copy each: the inputs, the trees' acceptance
        # arrays and the sampling parameters (staging buffers of their own: see Upload).
        self._inputs = Upload(self.device)
        self._tree_arrays = Upload(self.device)
        self._sampling = Upload(self.device, torch.float64)
        self._readback = Readback(self.device)  # the verdict's copy back, waited on in `collect`
        # Steps without a prompt chunk through bucketed static buffers (replayed CUDA graphs once
        # captured); None: every step runs eagerly at its own size.
        self.graphs = graphs

    def release(self, request_ids: tuple[str, ...] | list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)
            self._uniforms.pop(rid, None)
            self._tables.release(rid)

    def device_works(self, block_id: int) -> bool:
        """Whether a plain one-token forward still runs, writing its K/V into `block_id` (a
        block outside the scheduler's pool, which no request reads)."""
        probe = ScheduledRequest(PROBE_ID, (0,), 0, (block_id,), None, True, SamplingParams(max_new_tokens=1))
        try:
            self.execute(SchedulerOutput((probe,), ()))
            return True
        except Exception:
            logger.exception("the device probe failed too")
            return False
        finally:
            self.release([PROBE_ID])

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """One step start to end: `collect(launch(out))`."""
        return self.collect(self.launch(out))

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> LaunchedStep:
        """Pack, stage and plan the step, queue its forward, token choice and acceptance, and
        start the copy of the verdict back to the host. On a CUDA device this returns while the
        kernels run (the host may do other work until `collect`); on the CPU the forward has run."""
        clock = PhaseClock()
        self.release(out.finished_request_ids)
        step = pack(out.requests, self._tables, self.backend.block_size)
        self.backend.seconds = 0.0
        launch, staged = self._launch(step)
        clock.charge("prepare", until=staged)
        logits = launch()  # [K, V]; on CUDA the kernels are queued and still running
        scored, logits = logits[step.num_verify :], logits[: step.num_verify]  # prompt scoring's rows apart
        clock.charge("forward")
        # Host work the kernels do not wait for: counted as prepare.
        sampling = [(i, r) for i, r in enumerate(out.requests) if r.sample]
        trees = TreeRows.of(
            [(int(step.logit_start[i]), r.draft, r.window.num_outputs if r.window else 0) for i, r in sampling]
        )
        sampled = self._sampled_rows(out, step.logit_start, logits.shape[-1])
        clock.charge("prepare")
        raw = self._raw_rows(logits, sampling, step.logit_start)  # before anything changes them
        penalized = [(int(step.logit_start[i]), r) for i, r in sampling if r.params.penalized]
        if penalized:
            penalize(logits, penalized)
        clock.charge("forward")
        masks = [
            (int(step.logit_start[i]), r.token_mask) for i, r in enumerate(out.requests) if r.token_mask is not None
        ]
        if masks:
            apply_token_masks(logits, masks)
            clock.charge("grammar")
        # Token choice and acceptance on the logits' device; the step's one copy back starts now.
        chosen = accept(choose_on_device(logits, sampled), trees, self._tree_arrays) if sampling else None
        verdict = self._readback.start(chosen) if chosen is not None else None
        clock.charge("forward")
        return LaunchedStep(out, step, sampling, raw, scored, verdict, clock)

    @torch.inference_mode()
    def collect(self, launched: LaunchedStep) -> RunnerOutput:
        """Wait for a launched step's verdict and finish verification on the host: accepted paths,
        KV compaction (queued before any later forward), logprobs. Time between `launch` and this
        call is the forward's: the host did other work while the device ran."""
        clock, sampling, step = launched.clock, launched.sampling, launched.step
        verdict = Verdict.of(Readback.wait(launched.verdict) if launched.verdict is not None else [], len(sampling))
        clock.charge("forward")
        output = self._emit(sampling, step, verdict, launched.raw)
        if len(launched.scored):
            output.prompt_logprobs.update(prompt_logprobs(launched.out.requests, launched.scored))
        clock.charge("verify")
        phases, spent = output.phases, clock.spent
        phases.prepare, phases.forward = spent["prepare"], spent["forward"]
        phases.verify, phases.grammar = spent["verify"] + spent["grammar"], spent["grammar"]
        phases.attention = self.backend.seconds if self.backend.timed else None
        return output

    @torch.inference_mode()
    def logits(self, out: SchedulerOutput) -> torch.Tensor:
        """[K, V] the kept rows' logits of one step, nothing chosen or compacted (for checks)."""
        launch, _ = self._launch(pack(out.requests, self._tables, self.backend.block_size))
        return launch()

    def _launch(self, step: PackedStep) -> tuple[Callable[[], torch.Tensor], float]:
        """Stage the step's inputs and plan its attention; returns (a call that runs the forward
        and gives the kept rows' logits [K, V], the time staging ended). A step without a prompt
        chunk goes through its bucket's static buffers (a graph replay where captured)."""
        replayable = self.graphs is not None and step.num_verify == len(step.keep)  # graphs keep no scoring rows
        bucket = self.graphs.bucket_for(step.layout) if replayable and self.graphs is not None else None
        if bucket is not None:
            graphs = self.graphs
            assert graphs is not None
            metadata, kept = graphs.prepare(step, bucket)
            return (lambda: graphs.forward(bucket, metadata, kept)), time.perf_counter()
        ids, pos, slots, keep = self._to_device(step.input_ids, step.positions, step.slot_mapping, step.keep)
        metadata = self.backend.build_metadata(step.layout, slots)

        def forward() -> torch.Tensor:
            kwargs = {"use_cache": False, "logits_to_keep": keep, "attn_metadata": metadata}
            return self.model(input_ids=ids[None], position_ids=pos[None], **kwargs).logits[0]

        return forward, time.perf_counter()

    @staticmethod
    def _raw_rows(
        logits: torch.Tensor, sampling: list[tuple[int, ScheduledRequest]], logit_start: np.ndarray
    ) -> tuple[torch.Tensor, dict[str, int]] | None:
        """The raw logits of the requests that ask for logprobs, and where each request's rows
        (root and draft nodes) start in them; None if none asks. `logits` itself where none of
        these requests has its rows changed before the choice (penalties, a grammar mask: in
        place), else a copy of their rows taken now."""
        asking = [(i, r) for i, r in sampling if r.params.logprobs is not None]
        if not asking:
            return None
        if not any(r.params.penalized or r.token_mask is not None for _, r in asking):
            return logits, {r.request_id: int(logit_start[i]) for i, r in asking}
        rows: list[np.ndarray] = []
        at: dict[str, int] = {}
        for i, r in asking:
            at[r.request_id] = sum(map(len, rows))
            start = int(logit_start[i])
            rows.append(np.arange(start, start + 1 + (len(r.draft) if r.draft is not None else 0)))
        return logits[torch.from_numpy(np.concatenate(rows)).to(logits.device)], at

    def _emit(
        self,
        sampling: list[tuple[int, ScheduledRequest]],
        step: PackedStep,
        verdict: Verdict,
        raw: tuple[torch.Tensor, dict[str, int]] | None = None,
    ) -> RunnerOutput:
        """The host's share of verification: each request's accepted path and tokens from the
        step's verdict (its deepest accepted row, the bonus token, the window tokens), the KV
        compaction of accepted nodes, the uniforms the sampled tokens used, and the logprobs of
        the emitted tokens where asked (from `raw`, at the rows that chose them)."""
        bs = self.backend.block_size
        deepest, bonus, windows = verdict.deepest, verdict.bonus, verdict.windows
        out = RunnerOutput(emitted={}, accepted={}, phases=StepPhases())
        moves: list[tuple[int, int, int]] = []  # (request, from KV index, to KV index)
        consumed: list[tuple[str, int]] = []  # (sampling request, uniforms its emitted tokens used)
        asks: list[LogprobsAsk] = []  # (request, its rows in raw, its tokens, top): one call for all
        w = 0
        for j, (i, r) in enumerate(sampling):
            accepted = accepted_path(r.draft, int(step.logit_start[i]), deepest[j])
            tokens = [r.draft.tokens[node] for node in accepted] if r.draft is not None else []
            tokens.append(bonus[j])
            if r.window is not None:  # kept after the tree: the window's output rows, argmax
                out.window_outputs[r.request_id] = windows[w : w + r.window.num_outputs]
                w += r.window.num_outputs
            out.emitted[r.request_id] = tokens
            out.accepted[r.request_id] = accepted
            if raw is not None and r.request_id in raw[1]:
                first = raw[1][r.request_id]
                rows = [first] + [first + 1 + node for node in accepted]  # the rows that chose them
                asks.append((r.request_id, rows, tokens, r.params.logprobs or 0))
            if not r.params.greedy:
                consumed.append((r.request_id, len(tokens)))
            # Compaction: accepted node i sits at KV index base + i; it belongs at base + k.
            base = r.num_computed_tokens + len(r.token_ids)
            moves.extend((i, base + node, base + k) for k, node in enumerate(accepted) if node != k)
        if asks and raw is not None:  # every asking request's rows in one call per top count
            out.logprobs.update(requests_logprobs(raw[0], asks))
        if moves:
            req, src, dst = (np.array(m, np.int64) for m in zip(*moves))
            table = step.layout.block_table[req]  # [M, W]
            self.backend.copy_slots(torch.from_numpy(_slots(table, src, bs)), torch.from_numpy(_slots(table, dst, bs)))
        # Only now, with nothing left to raise: a retried step must find the same uniforms.
        for rid, n in consumed:
            del self._uniforms[rid][:n]
        return out

    def _to_device(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Host int64 arrays as device tensors: zero-copy on CPU, one pinned copy on CUDA."""
        return self._inputs(*arrays)

    def _sampled_rows(self, out: SchedulerOutput, logit_start: np.ndarray, vocab: int) -> SampledRows | None:
        """Parameters and uniforms of the kept rows of sampling (non-greedy) requests."""
        rows: list[int] = []
        params: list[tuple[float, int, float]] = []
        uniforms: list[float] = []
        for i, r in enumerate(out.requests):
            if not r.sample or r.params.greedy:
                continue
            depths = (0, *r.draft.depths) if r.draft is not None else (0,)
            stream = self._uniform_stream(r.request_id, r.params.seed, max(depths) + 1, r.num_output_tokens)
            start = int(logit_start[i])
            rows.extend(range(start, start + len(depths)))
            params.extend([(r.params.temperature, r.params.top_k, r.params.top_p)] * len(depths))
            uniforms.extend(stream[d] for d in depths)  # a row at depth d draws the d-th next uniform
        if not rows:
            return None
        temperature, top_k, top_p = zip(*params)
        cuts = [k for k in top_k if 0 < k < vocab]  # a cut at or past the vocabulary keeps every token
        # One float64 copy: ids and top-k are exact in it, and float32 rounds the same on either side.
        rows_d, temperature_d, top_k_d, top_p_d, uniform_d = self._sampling(
            np.array(rows, np.float64), np.array(temperature), np.array(top_k, np.float64), np.array(top_p),
            np.array(uniforms),
        )  # fmt: skip
        return SampledRows(
            rows=rows_d.long(),
            temperature=temperature_d.float(),
            top_k=top_k_d.long(),
            top_p=top_p_d.float(),
            uniform=uniform_d,
            max_top_k=max(cuts, default=0),
            any_top_p=any(p < 1.0 for p in top_p),
        )

    def _uniform_stream(self, request_id: str, seed: int | None, n: int, done: int = 0) -> list[float]:
        """The request's next `n` (or more) unused uniforms. Drawn from its seeded generator in
        fixed chunks, so the stream is the same however many tokens each step consumes. `done`:
        tokens its output held before its first sampling step here (a resumed request), whose
        uniforms are passed over."""
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator(device="cpu")
            gen.manual_seed(seed if seed is not None else random.getrandbits(63))
            self._uniforms[request_id] = []
            self._draw(request_id, gen, done)
            del self._uniforms[request_id][:done]
        self._draw(request_id, gen, n)
        return self._uniforms[request_id]

    def _draw(self, request_id: str, gen: torch.Generator, n: int) -> None:
        stream = self._uniforms[request_id]
        while len(stream) < n:
            stream.extend(torch.rand(UNIFORM_CHUNK, generator=gen, dtype=torch.float64).tolist())
