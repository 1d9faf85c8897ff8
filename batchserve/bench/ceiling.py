"""`batchserve bench --ceiling`: how many tokens a step copying the input can reach on a workload.

The model's own greedy outputs for a dataset's test prompts are replayed (target-guided, with
`simulate.replay`, as `--simulate` replays reference answers) through two drafters, at each
decoding length:
- the trie drafter, warmed with the dev split's outputs as the bench warms it, the requests
  replayed one after another as a server at batch 1 would see them;
- a clairvoyant copier that, each step, drafts the longest continuation of the true output found
  anywhere in the request's prompt and output so far. No drafter that copies the request's own
  text can accept more a step; the gap between the two is what better copying could still win,
  before the cost of verifying it. (The trie can exceed it where its warmed outputs hold text
  the request has not seen.)
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
from batchserve.draft import TrieDrafter
from batchserve.request import SamplingParams, tokens_per_step


@dataclass(frozen=True, slots=True)
class CeilingRow:
    dataset: str
    decoding_length: int
    num_prompts: int
    output_tokens: int
    trie_tokens_per_step: float
    copier_tokens_per_step: float


def longest_copy(context: np.ndarray, target: Sequence[int]) -> int:
    """The longest prefix of `target` that occurs anywhere in `context` [n] (as a run of it)."""
    if not len(target) or not len(context):
        return 0
    starts = np.flatnonzero(context == target[0])  # [k] where a copy could start
    m = 0
    while len(starts):
        m += 1
        if m == len(target):
            break
        starts = starts[starts + m < len(context)]
        starts = starts[context[starts + m] == target[m]]
    return m


def copier_steps(prompt: Sequence[int], output: Sequence[int], decoding_length: int) -> int:
    """Steps the clairvoyant copier needs to emit `output` after `prompt`: each step accepts the
    longest copy (at most `decoding_length` tokens, and none past the output's last token) and
    the model's own next token."""
    tokens = np.asarray([*prompt, *output], dtype=np.int64)
    done, steps = 0, 0
    while done < len(output):
        room = min(decoding_length, len(output) - done - 1)
        accepted = longest_copy(tokens[: len(prompt) + done], output[done : done + room]) if room > 0 else 0
        done += accepted + 1
        steps += 1
    return steps


def replay(
    dataset: str, prompts: list[list[int]], outputs: list[list[int]], warm: list[list[int]], length: int
) -> CeilingRow:
    """One row: the trie's and the copier's tokens a step over a workload's outputs."""
    samples = [Encoded(p, o) for p, o in zip(prompts, outputs)]
    trie = simulate.replay(lambda: TrieDrafter(DraftConfig(method="lookahead")), warm, samples, length)
    tokens = sum(map(len, outputs))
    copier = sum(copier_steps(p, o, length) for p, o in zip(prompts, outputs))
    return CeilingRow(
        dataset,
        length,
        len(prompts),
        tokens,
        round(trie.tokens_per_step, 3),
        round(tokens_per_step(tokens, copier), 3),
    )


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
        rows += [replay(dataset, workload.prompts, outputs, workload.warm, n) for n in lengths]
    return rows


def report_lines(rows: list[CeilingRow], max_new_tokens: int) -> list[str]:
    lines = [
        f"# Copy ceiling: the model's greedy outputs ({max_new_tokens} new tokens at most) replayed",
        "",
        "Tokens a step (emitted per verification step, the model's own token included) of the warmed trie",
        "drafter and of a clairvoyant copier that drafts the longest continuation found in the request's",
        "prompt and output so far: no drafter copying the request's own text accepts more.",
        "",
        "| dataset | prompts | output tokens | decoding length | trie | copier | trie / copier |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        share = r.trie_tokens_per_step / r.copier_tokens_per_step if r.copier_tokens_per_step else 0.0
        lines.append(
            f"| {r.dataset} | {r.num_prompts} | {r.output_tokens} | {r.decoding_length} "
            f"| {r.trie_tokens_per_step:.2f} | {r.copier_tokens_per_step:.2f} | {share:.0%} |"
        )
    return lines


def main(
    datasets: list[str], lengths: list[int], num_prompts: int, max_new_tokens: int, model: str | None, out: Path
) -> list[CeilingRow]:
    """Generate with the engine's default settings, replay, and write ceiling.md and ceiling.json."""
    from batchserve.llm import LLM

    llm = LLM(model, draft="lookahead")
    rows = ceiling_rows(llm, datasets, lengths, num_prompts, max_new_tokens)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ceiling.json").write_text(json.dumps([asdict(r) for r in rows], indent=1))
    (out / "ceiling.md").write_text("\n".join(report_lines(rows, max_new_tokens)) + "\n")
    return rows
