"""Runs one engine step: pack the scheduled requests into one ragged forward, verify, sample."""

from __future__ import annotations

import random
import time
from typing import Any

import torch

from batchserve.attention.base import AttentionBackend, SeqLayout, slots_of
from batchserve.runner.sampler import verify
from batchserve.scheduler.output import RunnerOutput, SchedulerOutput, StepPhases

ATTN_IMPL = "batchserve"


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    attn_metadata: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention hook: hand the layer's q/k/v to the step's backend."""
    if attn_metadata is None:
        raise RuntimeError("batchserve attention called without attn_metadata (use ModelRunner)")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = attn_metadata.backend.forward(module.layer_idx, query, key, value, attn_metadata, scale)
    return out, None


def register_attention() -> None:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPL, _attention)
    # Our backend builds its own masks; HF must not materialize a dense one.
    AttentionMaskInterface.register(ATTN_IMPL, lambda *args, **kwargs: None)


class ModelRunner:
    """Owns the model, the attention backend (and with it the KV pool) and per-request RNGs.

    Runs in the engine's worker thread; everything it reads per step comes in the
    SchedulerOutput, and the only state it keeps is tensors and generators.
    """

    def __init__(self, model: Any, backend: AttentionBackend) -> None:
        register_attention()
        model.set_attn_implementation(ATTN_IMPL)
        self.model = model
        self.backend = backend
        self.device = next(model.parameters()).device
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_ids: tuple[str, ...] | list[str]) -> None:
        for rid in request_ids:
            self._generators.pop(rid, None)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        self.release(out.finished_request_ids)
        bs = self.backend.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        seqs: list[SeqLayout] = []
        slot_parts: list[torch.Tensor] = []
        keep_rows: list[int] = []  # rows whose logits we need, request by request
        for r in out.requests:
            p, c = r.num_computed_tokens, len(r.token_ids)
            draft = r.draft
            n = len(draft) if draft is not None else 0
            q_start = len(input_ids)
            input_ids.extend(r.token_ids)
            positions.extend(range(p, p + c))
            if draft is not None:
                input_ids.extend(draft.tokens)
                # RoPE position of a node is its depth below the root (the chunk's last token).
                positions.extend(p + c - 1 + d for d in draft.depths)
            seqs.append(SeqLayout(q_start, c + n, p, c, draft.parents if draft else (), r.block_ids))
            slot_parts.append(slots_of(r.block_ids, bs, torch.arange(p, p + c + n)))
            if r.sample:
                keep_rows.extend(range(q_start + c - 1, q_start + c + n))

        num_tokens = len(input_ids)
        metadata = self.backend.build_metadata(seqs, num_tokens, torch.cat(slot_parts))
        ids = torch.tensor([input_ids], dtype=torch.long, device=self.device)  # [1, T]
        pos = torch.tensor([positions], dtype=torch.long, device=self.device)  # [1, T]
        keep = torch.tensor(keep_rows, dtype=torch.long, device=self.device)  # [K]
        t1 = time.perf_counter()
        logits = self.model(
            input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep, attn_metadata=metadata
        ).logits[0]  # [K, V]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the forward's phase ends when its logits exist
        t2 = time.perf_counter()
        argmax = logits.argmax(dim=-1).tolist()  # greedy choice of every kept row, in one call

        emitted: dict[str, list[int]] = {}
        accepted_nodes: dict[str, list[int]] = {}
        src: list[torch.Tensor] = []
        dst: list[torch.Tensor] = []
        row = 0
        for r in out.requests:
            if not r.sample:
                continue
            n = len(r.draft) if r.draft is not None else 0
            rows = slice(row, row + 1 + n)
            generator = None if r.params.greedy else self._generator(r.request_id, r.params.seed)
            tokens, accepted = verify(logits[rows], r.draft, r.params, generator, argmax[rows])
            row += 1 + n
            emitted[r.request_id] = tokens
            accepted_nodes[r.request_id] = accepted
            # Compaction: accepted node i sits at logical slot base + i; it belongs at base + j.
            base = r.num_computed_tokens + len(r.token_ids)
            moves = [(base + i, base + j) for j, i in enumerate(accepted) if i != j]
            if moves:
                s, d = zip(*moves)
                src.append(slots_of(r.block_ids, self.backend.block_size, torch.tensor(s)))
                dst.append(slots_of(r.block_ids, self.backend.block_size, torch.tensor(d)))
        if src:
            self.backend.copy_slots(torch.cat(src), torch.cat(dst))
        phases = StepPhases(prepare=t1 - t0, forward=t2 - t1, verify=time.perf_counter() - t2)
        return RunnerOutput(emitted=emitted, accepted=accepted_nodes, phases=phases)

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device="cpu")
            gen.manual_seed(seed if seed is not None else random.getrandbits(63))
            self._generators[request_id] = gen
        return gen
