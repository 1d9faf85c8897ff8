"""`batchserve bench --ceiling`: how many tokens a step copying the input can reach on a workload.

The model's own greedy outputs for a dataset's test prompts are replayed (target-guided, with
`simulate.replay`, as `--simulate` replays reference answers) at each decoding length through:
- the trie drafter, warmed with the dev split's outputs as the bench warms it, the requests
  replayed one after another as a server at batch 1 would see them; again with each sample's
  prediction as the request's predicted output, where the dataset has one (code edits);
- an anchored copier: each step, of the places right after an earlier occurrence of the token the
  request's text ends with, the one whose continuation agrees longest with the true output. Every
  branch a drafter takes from the request's prompt and output by matching what they end with (the
  trie's copy chain and token index, LLMA) starts at such a place, and a step accepts one path:
  so none of them accepts more a step; only other text (the scope's earlier outputs, a prediction
  not in the prompt) can take the trie past it;
- a clairvoyant copier that drafts the longest continuation of the true output found anywhere
  in the request's prompt and output so far, matched or not: no drafter that copies the request's
  own text can accept more. On the workloads measured, most of what it takes beyond the anchored
  copier are runs of one or two tokens that happen to recur somewhere, which no drafter could
  tell from the rest.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batchserve.bench import simulate
from batchserve.bench.simulate import Encoded
from batchserve.config import DraftConfig
from batchserve.request import SamplingParams, tokens_per_step


@dataclass(frozen=True, slots=True)
class CeilingRow:
    dataset: str
    decoding_length: int
    num_prompts: int
    output_tokens: int
    trie_tokens_per_step: float
    prediction_tokens_per_step: float | None  # the trie with each sample's prediction; None: the dataset has none
    anchored_tokens_per_step: float
    copier_tokens_per_step: float


def longest_copy(context: np.ndarray, target: Sequence[int]) -> int:
    """The longest prefix of `target` that occurs anywhere in `context` [n] (as a run of it)."""
    return _longest_from(context, target, np.arange(len(context)))


def anchored_copy(context: np.ndarray, target: Sequence[int]) -> int:
    """The longest prefix of `target` that follows an earlier occurrence of `context`'s last token."""
    if len(context) < 2:
        return 0
    return _longest_from(context, target, np.flatnonzero(context[:-1] == context[-1]) + 1)


def _longest_from(context: np.ndarray, target: Sequence[int], starts: np.ndarray) -> int:
    """How far the copy from the best of `starts` (places in `context` [n]) agrees with `target`."""
    m = 0
    while m < len(target):
        starts = starts[starts + m < len(context)]
        starts = starts[context[starts + m] == target[m]]
        if not len(starts):
            break
        m += 1
    return m


def copier_steps(prompt: Sequence[int], output: Sequence[int], decoding_length: int, anchored: bool = False) -> int:
    """Steps the clairvoyant copier (`anchored`: the anchored one) needs to emit `output` after
    `prompt`: each step accepts its copy (at most `decoding_length` tokens, and none past the
    output's last token) and the model's own next token."""
    copy = anchored_copy if anchored else longest_copy
    tokens = np.asarray([*prompt, *output], dtype=np.int64)
    done, steps = 0, 0
    while done < len(output):
        room = min(decoding_length, len(output) - done - 1)
        accepted = copy(tokens[: len(prompt) + done], output[done : done + room]) if room > 0 else 0
        done += accepted + 1
        steps += 1
    return steps


def replay(
    dataset: str,
    prompts: list[list[int]],
    outputs: list[list[int]],
    warm: list[list[int]],
    length: int,
    predictions: list[list[int]] | None = None,
) -> CeilingRow:
    """One row: the drafters' and the copiers' tokens a step over a workload's outputs
    (`predictions`: each prompt's predicted output, [] for none; None: the dataset has none)."""

    def trie(samples: list[Encoded]) -> float:
        drafter = simulate.replay(simulate.trie(DraftConfig(method="lookahead")), warm, samples, length)
        return round(drafter.tokens_per_step, 3)

    samples = [Encoded(p, o) for p, o in zip(prompts, outputs)]
    predicted = None
    if predictions is not None:
        predicted = trie([Encoded(p, o, r) for p, o, r in zip(prompts, outputs, predictions, strict=True)])
    tokens = sum(map(len, outputs))

    def copier(anchored: bool) -> float:
        steps = sum(copier_steps(p, o, length, anchored) for p, o in zip(prompts, outputs))
        return round(tokens_per_step(tokens, steps), 3)

    return CeilingRow(dataset, length, len(prompts), tokens, trie(samples), predicted, copier(True), copier(False))


def greedy_outputs(llm: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The model's greedy outputs (any lossless draft setting gives the same tokens)."""
    results = llm.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0), use_tqdm=True)
    return [list(r.token_ids) for r in results]


def ceiling_rows(
    llm: Any, datasets: list[str], lengths: list[int], num_prompts: int, max_new_tokens: int
) -> list[CeilingRow]:
    """Every (dataset, decoding length) row, the outputs generated once per dataset by `llm`."""
    from batchserve.bench.runs import load_dataset  # it imports torch-side bench code

    rows = []
    for dataset in datasets:
        workload = load_dataset(dataset, num_prompts, llm.tokenizer)
        outputs = greedy_outputs(llm, workload.prompts, max_new_tokens)
        predictions = None
        if any(workload.predictions):
            tokenize = llm.tokenizer
            predictions = [tokenize(p, add_special_tokens=False).input_ids if p else [] for p in workload.predictions]
        rows += [replay(dataset, workload.prompts, outputs, workload.warm, n, predictions) for n in lengths]
    return rows


def report_lines(rows: list[CeilingRow], max_new_tokens: int) -> list[str]:
    lines = [
        f"# Copy ceiling: the model's greedy outputs ({max_new_tokens} new tokens at most) replayed",
        "",
        "Tokens a step (emitted per verification step, the model's own token included) of the warmed trie",
        "drafter, of the same with each sample's prediction sent as the predicted output (where the dataset",
        "has one), of an anchored copier (the best place after an earlier occurrence of the text's last",
        "token: the most any drafter matching what the text ends with can take from the request's own",
        "text) and of a clairvoyant copier (the longest continuation found anywhere in the request's prompt",
        "and output so far: the most any drafter copying the request's own text can take).",
        "",
        "| dataset | prompts | output tokens | decoding length | trie | trie + prediction | anchored copier "
        "| copier | trie / anchored | trie / copier |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        predicted = "-" if r.prediction_tokens_per_step is None else f"{r.prediction_tokens_per_step:.2f}"
        lines.append(
            f"| {r.dataset} | {r.num_prompts} | {r.output_tokens} | {r.decoding_length} "
            f"| {r.trie_tokens_per_step:.2f} | {predicted} | {r.anchored_tokens_per_step:.2f} "
            f"| {r.copier_tokens_per_step:.2f} | {_share(r.trie_tokens_per_step, r.anchored_tokens_per_step)} "
            f"| {_share(r.trie_tokens_per_step, r.copier_tokens_per_step)} |"
        )
    return lines


def _share(part: float, whole: float) -> str:
    return f"{part / whole:.0%}" if whole else "-"


def main(
    datasets: list[str], lengths: list[int], num_prompts: int, max_new_tokens: int, model: str | None, out: Path
) -> list[CeilingRow]:
    """Generate with the engine's default settings, replay, and write ceiling.md and ceiling.json."""
    from batchserve import LLM

    llm = LLM(model, draft="lookahead")
    rows = ceiling_rows(llm, datasets, lengths, num_prompts, max_new_tokens)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ceiling.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    (out / "ceiling.md").write_text("\n".join(report_lines(rows, max_new_tokens)) + "\n")
    return rows
