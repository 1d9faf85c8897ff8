"""A request's share of a step as the runner gets it: its committed chunk (its tokens, and the
history its rows need: penalties' output so far, and the prompt for a repetition penalty; prompt
logprobs: which rows score which prompt tokens), its drafts with the KV slots for their rows,
and gathering the prompt logprobs the runner reported.

Prompt logprobs (`SamplingParams.prompt_logprobs`): row j of a chunk starting at KV index s
holds the model's distribution for the token at s + j + 1; tokens 1 .. P-1 of a P-token prompt
are scored, each exactly once (a preempted request recomputes its prompt without rescoring it)."""

from __future__ import annotations

from dataclasses import replace

from batchserve.records import RunnerOutput, ScheduledRequest
from batchserve.request import Request
from batchserve.scheduler.block_allocator import BlockAllocator
from batchserve.trees import DraftTree, WindowRows


def committed_chunk(req: Request, chunk: int, sample: bool) -> ScheduledRequest:
    """`req`'s next `chunk` committed tokens (from its computed K/V on); `sample`: they reach the
    end of its known tokens, so the step chooses its next token(s) (drafts are attached later)."""
    start = req.num_computed_tokens
    penalized = sample and req.params.penalized
    score_from, score_targets = score_span(req, start, chunk)
    return ScheduledRequest(
        request_id=req.request_id,
        token_ids=tuple(req.all_token_ids[start : start + chunk]),
        num_computed_tokens=start,
        block_ids=tuple(req.block_ids),
        draft=None,
        sample=sample,
        params=req.params,
        output_ids=tuple(req.output_token_ids) if penalized else (),
        prompt_ids=tuple(req.prompt_token_ids) if penalized and req.params.repetition_penalty != 1 else (),
        score_from=score_from,
        score_targets=score_targets,
        num_output_tokens=len(req.output_token_ids),
    )


def score_span(req: Request, start: int, chunk: int) -> tuple[int, tuple[int, ...]]:
    """(first row, the prompt tokens rows first.. predict) of `req`'s chunk of `chunk` tokens from
    KV index `start`; (0, ()) when it scores nothing."""
    if not req.scoring:
        return 0, ()
    first = max(0, len(req.prompt_logprobs) - start)  # the tokens before were scored already
    end = min(chunk, req.num_prompt_tokens - 1 - start)  # the last prompt row predicts the output
    if end <= first:
        return 0, ()
    return first, tuple(req.prompt_token_ids[start + first + 1 : start + end + 1])


def gather(req: Request, request_id: str, result: RunnerOutput) -> None:
    """Append the step's prompt logprobs of `req` (in prompt order: chunks run in order)."""
    entries = result.prompt_logprobs.get(request_id)
    if entries:
        req.prompt_logprobs.extend(entries)


def with_drafts(
    item: ScheduledRequest, req: Request, tree: DraftTree | None, window: WindowRows | None, pool: BlockAllocator
) -> ScheduledRequest:
    """`item` with its drafts hung off it, each where the pool has the blocks for its rows
    (speculation is optional: short of blocks, the window goes first, then the tree)."""
    if tree is None and window is None:
        return item
    end = item.num_computed_tokens + len(item.token_ids)
    rows = (len(tree) if tree is not None else 0) + (len(window) if window is not None else 0)
    if window is not None and not pool.grow(req.block_ids, end + rows):
        window, rows = None, rows - len(window)
    if tree is not None and not pool.grow(req.block_ids, end + rows):
        tree = None
    if tree is None and window is None:
        return item
    return replace(item, draft=tree, window=window, block_ids=tuple(req.block_ids))
