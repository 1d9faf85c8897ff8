"""`batchserve perplexity FILE --text PATH`: perplexity (and optionally the KL divergence against a
reference file) by llama-perplexity's convention, on the forward that serves, so quants of one
model can be compared with each other and with llama.cpp on the same file and text.

The convention (llama.cpp's `tools/perplexity/perplexity.cpp`): the text is tokenized once (BOS
first where the file adds one) and cut into chunks of `ctx` tokens; each chunk is one sequence of
its own whose first token is replaced by BOS (where added); the second half of each chunk is
scored: the logits at positions ctx/2 .. ctx-2 predict the tokens after them. PPL = exp(mean
negative log-likelihood), its error the standard error of that mean times PPL. With a reference
(`--kl-divergence BASE`), both models score the same tokens, and the KL divergence of this model's
distribution from the reference's and the top-1 agreement are reported per scored token.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

Scorer = Callable[[list[int], int], Any]  # (chunk tokens, first scored position) -> log-probs [n, V]


@dataclass(slots=True)
class Totals:
    """Running sums over scored tokens (float64)."""

    count: int = 0
    nll: float = 0.0
    nll2: float = 0.0
    kld: float = 0.0
    kld2: float = 0.0
    same_top: int = 0
    chunks: list[float] = field(default_factory=list)  # PPL so far after each chunk

    def ppl(self) -> tuple[float, float]:
        """(PPL, its error) as llama-perplexity prints them."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        err = math.sqrt(var / (self.count - 1)) if var > 0 and self.count > 1 else 0.0
        return math.exp(mean), err * math.exp(mean)

    def kl(self) -> tuple[float, float]:
        mean = self.kld / self.count
        var = self.kld2 / self.count - mean * mean
        return mean, math.sqrt(var / (self.count - 1)) if var > 0 and self.count > 1 else 0.0


@dataclass(frozen=True, slots=True)
class Result:
    file: str
    ctx: int
    chunks: int
    tokens_scored: int
    ppl: float
    ppl_error: float
    seconds: float
    kl_divergence: float | None = None
    kl_divergence_error: float | None = None
    same_top_p: float | None = None  # the share of scored tokens whose most likely next token agrees
    reference: str | None = None


def chunks_of(tokens: list[int], ctx: int, limit: int | None, bos: int | None) -> Iterator[list[int]]:
    """The chunks llama-perplexity evaluates: whole `ctx`-token slices (at most `limit`), each's first
    token BOS where the file adds one."""
    n = len(tokens) // ctx if limit is None else min(limit, len(tokens) // ctx)
    for i in range(n):
        chunk = tokens[i * ctx : (i + 1) * ctx]
        if bos is not None:
            chunk[0] = bos
        yield chunk


def accumulate(totals: Totals, chunk: list[int], first: int, logp: np.ndarray, base: np.ndarray | None) -> None:
    """Add one chunk's scored rows: `logp` [n, V] float64 log-probs at positions first..ctx-2 (and
    the reference's `base`, same shape) against the tokens after them."""
    targets = np.asarray(chunk[first + 1 :], dtype=np.int64)  # [n]
    nll = -logp[np.arange(len(targets)), targets]  # [n]
    totals.count += len(targets)
    totals.nll += float(nll.sum())
    totals.nll2 += float((nll * nll).sum())
    if base is not None:
        kld = (np.exp(base) * (base - logp)).sum(-1)  # [n]: KL(reference || this)
        totals.kld += float(kld.sum())
        totals.kld2 += float((kld * kld).sum())
        totals.same_top += int((base.argmax(-1) == logp.argmax(-1)).sum())
    totals.chunks.append(totals.ppl()[0])


def engine_scorer(path: str, ctx: int, threads: int | None) -> tuple[Scorer, Any, Any]:
    """(scorer, tokenizer, engine) for the model file at `path` on the forward that serves: each chunk
    is one prompt of its own on KV blocks no request holds, its scored rows' logits kept."""
    import torch

    from batchserve import EngineCore
    from batchserve.config import EngineConfig
    from batchserve.records import ScheduledRequest, SchedulerOutput
    from batchserve.request import SamplingParams

    block = 16
    blocks = -(-ctx // block)
    config = EngineConfig().with_settings(
        model=path, draft="none", block_size=block, num_blocks=max(64, blocks), max_model_len=max(ctx, 64),
        max_num_batched_tokens=max(ctx, 512), num_threads=threads,
    )  # fmt: skip
    core = EngineCore(config)
    runner = core.runner

    def score(chunk: list[int], first: int) -> Any:
        req = ScheduledRequest(
            "#perplexity", tuple(chunk), 0, tuple(range(blocks)), None, False, SamplingParams(),
            score_from=first, score_targets=tuple(chunk[first + 1 :]),
        )  # fmt: skip
        try:
            with torch.no_grad():
                logits = runner.logits(SchedulerOutput((req,), ()))  # [n, V]
        finally:
            runner.release(["#perplexity"])
        return torch.log_softmax(logits.double(), dim=-1).numpy()

    return score, core.tokenizer, core


def bos_of(path: str) -> int | None:
    """The BOS id llama.cpp puts first, or None where the file adds none."""
    from batchserve.model.gguf_read import read_gguf

    meta = read_gguf(path).metadata
    add = meta.get("tokenizer.ggml.add_bos_token")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if bos is None or (add is not None and not add.value):
        return None
    return int(bos.value)


def perplexity(
    path: str,
    text: str,
    ctx: int = 512,
    chunks: int | None = None,
    reference: str | None = None,
    threads: int | None = None,
    progress: Callable[[int, int, Totals], None] | None = None,
) -> Result:
    """Perplexity of the model file at `path` on `text` (see the module's docstring)."""
    if ctx < 8 or ctx % 2:
        raise ValueError(f"--ctx must be an even number >= 8, got {ctx}")
    if chunks is not None and chunks < 1:
        raise ValueError(f"--chunks must be >= 1, got {chunks}")
    t0 = time.perf_counter()
    score, tokenizer, _core = engine_scorer(path, ctx, threads)
    bos = bos_of(path)
    tokens = list(tokenizer.encode(text, add_special_tokens=False))
    if bos is not None:
        tokens.insert(0, bos)
    if len(tokens) < 2 * ctx:
        raise ValueError(f"the text is {len(tokens)} tokens: perplexity at --ctx {ctx} needs at least {2 * ctx}")
    base_score = engine_scorer(reference, ctx, threads)[0] if reference is not None else None
    first = ctx // 2
    todo = list(chunks_of(tokens, ctx, chunks, bos))
    totals = Totals()
    for i, chunk in enumerate(todo):
        logp = score(chunk, first)
        base = base_score(chunk, first) if base_score is not None else None
        accumulate(totals, chunk, first, logp, base)
        if progress is not None:
            progress(i + 1, len(todo), totals)
    ppl, err = totals.ppl()
    result = Result(path, ctx, len(todo), totals.count, ppl, err, time.perf_counter() - t0)
    if base_score is not None:
        kl, kl_err = totals.kl()
        result = Result(**{**asdict(result), "kl_divergence": kl, "kl_divergence_error": kl_err,
                           "same_top_p": totals.same_top / totals.count, "reference": reference})  # fmt: skip
    return result


def add_perplexity_parser(sub: Any) -> None:
    p = sub.add_parser("perplexity", help="perplexity (and KL divergence) of a model file, by llama-perplexity's rules")
    p.add_argument("model", help="the model file (GGUF) or directory")
    p.add_argument("--text", required=True, help="a UTF-8 text file to score")
    p.add_argument("--ctx", type=int, default=512, help="tokens per chunk; the second half is scored (default: 512)")
    p.add_argument("--chunks", type=int, default=None, help="score at most this many chunks (default: all)")
    p.add_argument(
        "--kl-divergence", dest="reference", default=None, metavar="BASE",
        help="a reference model file of the same vocabulary: the KL divergence from it, top-1 agreement",
    )  # fmt: skip
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: the server's choice)")
    p.add_argument("--json", default=None, help="also write the result to this JSON file")


def perplexity_command(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)  # the load's report
    try:
        text = Path(args.text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        print(f"batchserve perplexity: cannot read --text: {e}", file=sys.stderr)
        return 2

    def show(done: int, total: int, totals: Totals) -> None:
        print(f"[{done}/{total}] PPL {totals.chunks[-1]:.4f}", file=sys.stderr, flush=True)

    try:
        result = perplexity(args.model, text, args.ctx, args.chunks, args.reference, args.threads, show)
    except (FileNotFoundError, ValueError) as e:
        print(f"batchserve perplexity: {e}", file=sys.stderr)
        return 2
    print(f"Final estimate: PPL = {result.ppl:.4f} +/- {result.ppl_error:.5f} ({result.tokens_scored} tokens scored"
          f" in {result.chunks} chunks of {result.ctx}, {result.seconds:.1f} s)")  # fmt: skip
    if result.kl_divergence is not None:
        print(f"Mean KLD: {result.kl_divergence:.6f} +/- {result.kl_divergence_error:.6f};"
              f" same top p: {100 * (result.same_top_p or 0):.3f} %")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(asdict(result), indent=1))
    return 0
