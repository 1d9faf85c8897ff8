"""Measure forward time against tokens per step on this device (`batchserve calibrate`).

Each measurement is a real `ModelRunner.execute` of a synthetic step: one request whose KV
already holds `context` tokens, computing its last token plus a chain draft, so every row
also pays for its logits and verification, as draft rows do in serving. The KV pool must be
idle (nothing else running): the step writes into the first blocks of the pool.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchserve.cost_profile import CostProfile
from batchserve.records import ScheduledRequest, SchedulerOutput
from batchserve.request import SamplingParams
from batchserve.runner.profile_key import profile_key, profile_path
from batchserve.runner.runner import ModelRunner
from batchserve.trees import DraftTree

logger = logging.getLogger("batchserve")

# Dense where drafts live: on CPU the curve is not monotone there (a matmul with 2 or 3 rows
# can be slower than one with 8), and the policy should see the dips it can use. A kernel that
# works in row blocks steps up right after each block (torch's int4 kernel, the earlier Q4_1
# path, read every weight again for each 16-row block: a 17-row step cost far more than a 16-row
# one, not the 1/16 of the way to 32 rows interpolation would say), so 17, 33 and 65 are
# measured: at 16 or 32 requests the first draft row may be the most expensive one. Blocks of 4
# rows (on AVX2 that kernel's 5 rows cost what 8 did) are found from 5 and 9 (`row_block_of`).
TOKEN_COUNTS = (1, 2, 3, 4, 5, 6, 8, 9, 10, 12, 16, 17, 20, 24, 32, 33, 48, 64, 65, 96, 128, 192, 256, 384, 512)
CONTEXTS = (64, 512, 2048)
# What a server measures at its first start, in seconds rather than minutes: the shape of the
# curve at one context, coarsely. The policy's online fit refines it from the steps it serves;
# `batchserve calibrate` measures the whole curve.
QUICK_TOKEN_COUNTS = (1, 2, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 128, 256, 512)
# Two contexts: what a further request costs grows with its context (its attention row), and
# one context would price short-prompt batches at the long one's cost, or the reverse.
QUICK_CONTEXTS = (64, 512)
QUICK_REPEATS = 3
# What the quick profile may take (projected from one timing of each step shape, ascending): a large
# model on a few cores costs seconds a wide step, and all of QUICK_TOKEN_COUNTS would take minutes
# (an 8B on 2 cores: 512 rows, 20 s a step). The counts it can afford are measured; the curve
# extrapolates its last segment past them (rows cost alike once the products are compute-bound).
QUICK_BUDGET_S = 20.0
PER_SEQ_REQUESTS = 16  # requests in the step that measures the cost of one more request
# Draft rows per request in the step that measures what a draft row costs among many requests:
# uneven, as a budget hands them out (most requests get none or one, a few a deep tree), two a
# request on average. Tiled over the step's requests.
DRAFT_PATTERN = (0, 0, 1, 0, 2, 1, 5, 7)


def step_of(runner: ModelRunner, contexts: list[int], num_tokens: int) -> SchedulerOutput:
    """One request per entry of `contexts`, each computing 1 token plus a draft chain, with
    `num_tokens` rows in all (split as evenly as possible)."""
    n = len(contexts)
    rows = [num_tokens // n + (1 if i < num_tokens % n else 0) for i in range(n)]
    vocab = vocab_of(runner)
    return _requests(runner, contexts, [_chain(r - 1, vocab, i) for i, r in enumerate(rows)])


# The stride between a step's token ids: a prime, so that ids taken in turn modulo the vocabulary
# are distinct (siblings must differ) and spread over all of it.
STRIDE = 7919


def vocab_of(runner: ModelRunner) -> int:
    """The model's vocabulary size (its config's; 256 where it names none)."""
    config = getattr(runner.model, "config", None)
    return int(getattr(config, "vocab_size", 0) or 256)


def spread_tokens(n: int, vocab: int, start: int = 0) -> tuple[int, ...]:
    """n token ids spread over the vocabulary, distinct while n <= vocab: the rows of a mixture of
    experts then route as text's varied tokens do. Ids from a narrow range, all the step's roots
    one id, route alike: 16 requests would read one token's k experts where text reads about 16 k,
    and the profile would price a row of an MoE step far below its cost."""
    stride = STRIDE if vocab % STRIDE else STRIDE + 2
    return tuple((start + j) * stride % vocab for j in range(n))


# Where request r's draft ids start in `spread_tokens`' order: past the requests' own last
# tokens (the first ROOTS), then DRAFT_SPAN a request.
ROOTS, DRAFT_SPAN = 64, 512


def _draft_tokens(n: int, vocab: int, request: int) -> tuple[int, ...]:
    return spread_tokens(n, vocab, ROOTS + DRAFT_SPAN * request)


def _chain(n: int, vocab: int, request: int) -> DraftTree | None:
    return DraftTree.chain(_draft_tokens(n, vocab, request)) if n > 0 else None


def _tree(n: int, vocab: int, request: int) -> DraftTree | None:
    """n draft nodes shaped as a trie proposes them: two branches off the root, the first one deep."""
    if n < 2:
        return _chain(n, vocab, request)
    return DraftTree(_draft_tokens(n, vocab, request), (None, None, 0, *range(2, n - 1))[:n])


def _draft_step(runner: ModelRunner, contexts: list[int]) -> SchedulerOutput:
    """One request per entry of `contexts` with `DRAFT_PATTERN`'s trees (`_pattern_rows` draft rows)."""
    drafts = [DRAFT_PATTERN[i % len(DRAFT_PATTERN)] for i in range(len(contexts))]
    vocab = vocab_of(runner)
    return _requests(runner, contexts, [_tree(d, vocab, i) for i, d in enumerate(drafts)])


def _requests(runner: ModelRunner, contexts: list[int], drafts: list[DraftTree | None]) -> SchedulerOutput:
    """One request per entry of `contexts`, each computing 1 token (its own id: `spread_tokens`)
    plus its draft."""
    bs = runner.backend.block_size
    reqs = []
    next_block = 0
    roots = spread_tokens(len(contexts), vocab_of(runner))
    for i, (ctx, draft) in enumerate(zip(contexts, drafts)):
        rows = 1 + (len(draft) if draft is not None else 0)
        num_blocks = -(-(ctx + rows) // bs)
        blocks = tuple(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        reqs.append(
            ScheduledRequest(
                request_id=f"calibrate-{i}",
                token_ids=(roots[i],),
                num_computed_tokens=ctx,
                block_ids=blocks,
                draft=draft,
                sample=True,
                params=SamplingParams(max_new_tokens=rows + 1),
            )
        )
    return SchedulerOutput(requests=tuple(reqs), finished_request_ids=())


def row_block_of(counts: Sequence[int], step_ms: Sequence[float]) -> int:
    """The row block a measured curve shows: the smallest B of 4 and 8 where one row past B
    costs at least half of what the next B rows cost (a kernel that takes rows B at a time pays
    the whole block for its first row; on a linear curve it is 1/B); 1 where none does."""
    at = dict(zip(counts, step_ms))
    for b in (4, 8):
        if b in at and b + 1 in at and 2 * b in at and at[2 * b] > at[b]:
            if at[b + 1] - at[b] >= 0.5 * (at[2 * b] - at[b]):
                return b
    return 1


def _blocks_needed(runner: ModelRunner, contexts: list[int], num_tokens: int) -> int:
    bs = runner.backend.block_size
    return sum(-(-(c + num_tokens // len(contexts) + 1) // bs) for c in contexts)


def _time_once(runner: ModelRunner, out: SchedulerOutput) -> float:
    t0 = time.perf_counter()
    runner.execute(out)  # ends in .tolist(): synchronizes the device
    return (time.perf_counter() - t0) * 1e3


def lower_quartile(times: list[float]) -> float:
    """Interference on a shared machine only ever adds time, so the low end of a step's
    timings is its own cost; the lower quartile is that without trusting one lucky run."""
    return sorted(times)[len(times) // 4]


def curve_of(runner: ModelRunner, steps: list[SchedulerOutput], repeats: int, tick: Any) -> list[float]:
    """Each step's time, measured round-robin so that drift on a shared machine spreads over
    every point instead of bending one part of the curve. Not forced to be monotone: more
    rows can be faster (matmul kernels change with the row count), and the policy uses it."""
    for out in steps:
        runner.execute(out)  # warm-up (allocator, kernels)
    times: list[list[float]] = [[] for _ in steps]
    for _ in range(repeats):
        for i, out in enumerate(steps):
            times[i].append(_time_once(runner, out))
            tick()
    return [lower_quartile(t) for t in times]


def calibrate(
    runner: ModelRunner,
    *,
    max_tokens: int = 512,
    max_context: int = 4096,
    contexts: tuple[int, ...] = CONTEXTS,
    repeats: int = 9,
    key: str | None = None,
    progress: bool = True,
    token_counts: tuple[int, ...] = TOKEN_COUNTS,
) -> CostProfile:
    """Time steps of 1 to `max_tokens` rows at each context (that fits the model and pool)."""
    if max_tokens < 1 or repeats < 1:
        raise ValueError("max_tokens and repeats must be >= 1")
    counts = sorted({c for c in token_counts if c <= max_tokens} | {max_tokens})
    pool = runner.backend.num_blocks
    usable = [c for c in contexts if c + max_tokens <= max_context and _blocks_needed(runner, [c], max_tokens) <= pool]
    if not usable:  # a tiny pool or context window: measure the largest context that fits
        usable = [max(0, min(max_context - max_tokens, pool * runner.backend.block_size - max_tokens - 1))]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(usable) * (len(counts) + 4) * repeats, desc="calibrate", unit="step")

    def tick() -> None:
        if bar is not None:
            bar.update(1)

    rows: list[tuple[float, ...]] = []
    per_seq: list[float] = []
    per_draft: list[float] = []
    try:
        for ctx in usable:
            if bar is not None:
                bar.set_postfix_str(f"context {ctx}")
            rows.append(tuple(curve_of(runner, [step_of(runner, [ctx], n) for n in counts], repeats, tick)))
            seq_ms, draft_ms = _many_requests(runner, ctx, counts[-1], repeats, tick)
            per_seq.append(seq_ms)
            per_draft.append(draft_ms)
    finally:
        if bar is not None:
            bar.close()
        runner.release([f"calibrate-{i}" for i in range(PER_SEQ_REQUESTS)])
    return CostProfile(
        key=key or profile_key(runner),
        token_counts=tuple(counts),
        contexts=tuple(usable),
        step_ms=tuple(rows),
        per_seq_ms=tuple(per_seq),
        row_block=row_block_of(counts, rows[0]),
        draft_ms=tuple(per_draft),
    )


def _many_requests(runner: ModelRunner, ctx: int, max_rows: int, repeats: int, tick: Any) -> tuple[float, float]:
    """What each further request in a step adds (the same rows from one request and from n), and
    what each draft row adds among m <= n requests (`DRAFT_PATTERN`'s trees) beyond one request's
    chain of as many rows and the requests' own cost; 0 where the pool or `max_rows` allow too
    few requests for the pattern."""
    pool, deepest = runner.backend.num_blocks, max(DRAFT_PATTERN) + 1
    n = min(PER_SEQ_REQUESTS, max_rows)
    while n > 1 and _blocks_needed(runner, [ctx] * n, n) > pool:
        n //= 2
    m = n
    while m >= len(DRAFT_PATTERN) and (
        _blocks_needed(runner, [ctx] * m, m * deepest) > pool or m + _pattern_rows(m) > max_rows
    ):
        m //= 2
    steps = [step_of(runner, [ctx], n), step_of(runner, [ctx] * n, n)] if n > 1 else []
    if m >= len(DRAFT_PATTERN):
        steps += [step_of(runner, [ctx], m + _pattern_rows(m)), _draft_step(runner, [ctx] * m)]
    times = curve_of(runner, steps, repeats, tick)
    for _ in range((4 - len(steps)) * repeats):
        tick()
    if n < 2:
        return 0.0, 0.0
    seq_ms = max(0.0, (times[1] - times[0]) / (n - 1))
    if len(times) < 4:
        return seq_ms, 0.0
    chain, trees = times[2:]
    return seq_ms, max(0.0, (trees - chain - seq_ms * (m - 1)) / _pattern_rows(m))


def _pattern_rows(m: int) -> int:
    """Draft rows of `DRAFT_PATTERN` tiled over m requests."""
    return sum(DRAFT_PATTERN[i % len(DRAFT_PATTERN)] for i in range(m))


def affordable_counts(
    runner: ModelRunner, counts: Sequence[int], ctx: int, runs: int, budget_s: float
) -> tuple[int, ...]:
    """The ascending prefix of `counts` (at least two) whose curve, `runs` timings of each step shape
    and of the per-request steps (`_many_requests`: four of about min(16, rows) rows), is projected to
    take at most `budget_s` with this projection's own timing (each shape once, at context `ctx`)."""
    kept: list[int] = []
    times: dict[int, float] = {}
    for n in sorted(counts):
        if _blocks_needed(runner, [ctx], n) > runner.backend.num_blocks:
            break
        times[n] = _time_once(runner, step_of(runner, [ctx], n)) / 1e3
        per_request = 4 * times[max([c for c in times if c <= PER_SEQ_REQUESTS] or [min(times)])]
        if len(kept) >= 2 and sum(times.values()) + runs * (sum(times.values()) + per_request) > budget_s:
            break
        kept.append(n)
    return tuple(kept or counts[:1])


def load_or_calibrate(runner: ModelRunner, path: str | Path | None, max_tokens: int, max_context: int) -> CostProfile:
    """The cached profile for this model and device, measuring (and saving) it if absent."""
    key = profile_key(runner)
    target = Path(path) if path is not None else profile_path(key)
    if target.exists():
        try:
            profile = CostProfile.load(target)
        except ValueError:
            if path is not None:  # the operator named this file: say it is wrong
                raise
            logger.warning("cached cost profile %s is damaged: measuring it again", target)
        else:
            if profile.key != key:
                logger.warning("cost profile %s was measured for %r, not %r", target, profile.key, key)
            logger.info("cost profile %s: critical decoding length %d", target, profile.critical_decoding_length())
            return profile
    t0 = time.perf_counter()
    wanted = sorted({c for c in QUICK_TOKEN_COUNTS if c <= max_tokens} | {max_tokens})
    runs = len(QUICK_CONTEXTS) * (QUICK_REPEATS + 1)  # calibrate's warm-up and repeats at each context
    counts = affordable_counts(runner, wanted, QUICK_CONTEXTS[0], runs, QUICK_BUDGET_S)
    logger.info(
        "no cost profile for %s yet: a quick one (%d step shapes, up to %d rows%s, x %d runs) before serving; the "
        "policy refines it online, and `batchserve calibrate` measures the whole curve",
        key,
        len(counts) + 4,
        counts[-1],
        "" if counts[-1] == wanted[-1] else f" of {wanted[-1]}: the rest extrapolated, to fit {QUICK_BUDGET_S:.0f} s",
        QUICK_REPEATS,
    )
    profile = calibrate(
        runner,
        max_tokens=counts[-1],
        max_context=max_context,
        contexts=QUICK_CONTEXTS,
        repeats=QUICK_REPEATS,
        key=key,
        token_counts=counts,
    )
    logger.info("quick cost profile measured in %.1f s", time.perf_counter() - t0)
    try:
        profile.save(target)
    except OSError as e:  # a read-only or full cache: serve with the profile in memory
        logger.warning("could not save cost profile %s (%s); it will be measured again on the next start", target, e)
        return profile
    logger.info("saved cost profile %s: critical decoding length %d", target, profile.critical_decoding_length())
    return profile
