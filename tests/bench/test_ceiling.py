"""`batchserve bench --ceiling`: the clairvoyant copier, the replay against it, and the command."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from batchserve.bench import ceiling
from batchserve.bench.ceiling import anchored_copy, copier_steps, longest_copy, replay
from batchserve.cli import main
from tests.conftest import tiny_llm


def test_longest_copy_finds_the_longest_prefix_anywhere_in_the_context() -> None:
    context = np.array([5, 1, 2, 9, 1, 2, 3, 4, 7])
    assert longest_copy(context, [1, 2, 3, 4, 8]) == 4  # the second occurrence goes further
    assert longest_copy(context, [4, 7, 5]) == 2  # a copy stops at the context's end
    assert longest_copy(context, [6, 1]) == 0
    assert longest_copy(context, []) == 0 and longest_copy(np.array([], dtype=np.int64), [1]) == 0


def test_the_anchored_copy_starts_only_after_an_earlier_occurrence_of_the_last_token() -> None:
    context = np.array([5, 1, 2, 9, 7, 1, 2, 3, 4, 7])  # ends with 7: copies start at 5 (after the first 7) only
    assert anchored_copy(context, [1, 2, 3, 4, 8]) == 4
    assert longest_copy(context, [2, 9, 7]) == 3 and anchored_copy(context, [2, 9, 7]) == 0  # 2 follows no 7
    assert anchored_copy(np.array([3, 1, 3, 2, 3]), [1, 3]) == 2  # after the first 3; after the second: [2, 3]
    assert anchored_copy(np.array([3, 1, 3, 2, 3]), [2, 3, 9]) == 2
    assert anchored_copy(np.array([4, 4]), [4, 4]) == 1  # the copy stops at the context's end
    assert anchored_copy(np.array([4]), [4]) == 0 and anchored_copy(context, []) == 0


def test_the_copier_copies_what_it_has_seen_and_pays_a_step_for_each_new_token() -> None:
    prompt, output = [1, 2, 3, 4, 5], [9, 1, 2, 3, 4, 5, 7]
    # 9 is new (one step); then 1..5 are a copy and 7 the model's own token: one step.
    assert copier_steps(prompt, output, 16) == 2
    # Two draft tokens a step: [1, 2] + 3, then [4, 5] + 7.
    assert copier_steps(prompt, output, 2) == 3
    # Nothing to copy: a step a token. A copy of its own output counts too.
    assert copier_steps([], [1, 2, 3], 16) == 3
    # 1, 2, then [1, 2] + 1 (a copy cannot run past the text seen when it is drafted), then 2.
    assert copier_steps([], [1, 2, 1, 2, 1, 2], 16) == 4
    # Anchored: 9 new; 1 follows no earlier 9, so [1] alone; then after 1: [2, 3, 4, 5] + 7.
    assert copier_steps(prompt, output, 16, anchored=True) == 3
    # After 2: nothing followed an earlier 2 yet; after the first [1, 2]: [1, 2] + 1 ... as above.
    assert copier_steps([], [1, 2, 1, 2, 1, 2], 16, anchored=True) == 4


def _copying_sample(rng: random.Random) -> tuple[list[int], list[int]]:
    """A prompt and an output that copies runs of it, with new tokens between."""
    prompt = [rng.randrange(2, 40) for _ in range(rng.randint(20, 80))]
    output: list[int] = []
    while len(output) < 60:
        if rng.random() < 0.6:
            start = rng.randrange(len(prompt))
            output += prompt[start : start + rng.randint(2, 12)]
        else:
            output.append(rng.randrange(40, 60))
    return prompt, output


@pytest.mark.parametrize("length", [1, 4, 16])
def test_no_drafter_copying_the_requests_own_text_beats_the_copier(length: int) -> None:
    rng = random.Random(length)
    for _ in range(10):
        prompt, output = _copying_sample(rng)
        row = replay("x", [prompt], [output], warm=[], length=length)  # nothing but its own text to draft from
        assert row.trie_tokens_per_step <= row.anchored_tokens_per_step <= row.copier_tokens_per_step
        assert row.copier_tokens_per_step == round(len(output) / copier_steps(prompt, output, length), 3)
        assert row.anchored_tokens_per_step == round(len(output) / copier_steps(prompt, output, length, True), 3)
        assert row.prediction_tokens_per_step is None
        if length > 1:
            assert row.copier_tokens_per_step > 1.0  # the output copies the prompt: there is something to win


@pytest.mark.parametrize("length", [1, 4, 16])
def test_a_prediction_of_the_whole_output_is_copied_whole_every_step(length: int) -> None:
    prompt, output = _copying_sample(random.Random(7))
    wrong = [t + 100 for t in output]  # shares no token with the output
    row = replay("x", [prompt, prompt], [output, output], warm=[], length=length, predictions=[output, []])
    alone = replay("x", [prompt], [output], warm=[], length=length, predictions=[output])
    # Every step drafts the rest of the prediction up to the budget and all of it is accepted.
    assert alone.prediction_tokens_per_step == round(len(output) / -(-len(output) // (length + 1)), 3)
    assert row.prediction_tokens_per_step is not None and row.prediction_tokens_per_step > row.trie_tokens_per_step
    missed = replay("x", [prompt], [output], warm=[], length=length, predictions=[wrong])
    assert missed.prediction_tokens_per_step is not None and missed.prediction_tokens_per_step >= 1.0


def test_the_ceiling_replays_a_tiny_models_own_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = tiny_llm(draft="lookahead")
    monkeypatch.setattr("batchserve.llm.LLM", lambda *args, **kwargs: llm)  # main builds its LLM by name
    rows = ceiling.main(["humaneval"], [2, 8], num_prompts=3, max_new_tokens=12, model=None, out=tmp_path)
    assert [(r.dataset, r.decoding_length, r.num_prompts) for r in rows] == [("humaneval", 2, 3), ("humaneval", 8, 3)]
    assert all(r.output_tokens > 0 and r.copier_tokens_per_step >= 1.0 for r in rows)
    assert rows[0].copier_tokens_per_step <= rows[1].copier_tokens_per_step  # longer drafts copy at least as far
    saved = json.loads((tmp_path / "ceiling.json").read_text())
    assert [r["decoding_length"] for r in saved] == [2, 8]
    assert "| humaneval | 3 |" in (tmp_path / "ceiling.md").read_text()
    assert all(r.prediction_tokens_per_step is None for r in rows)  # HumanEval sends no prediction
    assert all(r.trie_tokens_per_step >= 1.0 and r.anchored_tokens_per_step <= r.copier_tokens_per_step for r in rows)


def test_the_ceiling_replays_a_workloads_predictions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = tiny_llm(draft="lookahead")
    monkeypatch.setattr("batchserve.llm.LLM", lambda *args, **kwargs: llm)
    lines = [{"prompt": f"def f{i}(x):\n    return x + {i}\n", "prediction": f"def f{i}(x):\n"} for i in range(3)]
    lines.append({"prompt": "no prediction here"})  # a line without one replays with none
    workload = tmp_path / "edits.jsonl"
    workload.write_text("".join(json.dumps(line) + "\n" for line in lines))
    (row,) = ceiling.main([str(workload)], [8], num_prompts=4, max_new_tokens=12, model=None, out=tmp_path / "out")
    assert row.num_prompts == 4
    assert row.prediction_tokens_per_step is not None and row.prediction_tokens_per_step >= 1.0
    text = (tmp_path / "out" / "ceiling.md").read_text()
    assert f"| {row.prediction_tokens_per_step:.2f} |" in text and "trie + prediction" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ceiling", "--simulate"], "choose one"),
        (["--ceiling", "--decoding-lengths", "0"], "must be >= 1"),
        (["--ceiling", "--max-new-tokens", "0"], "must be >= 1"),
        (["--ceiling", "--dataset", "nope"], "unknown dataset"),
    ],
)
def test_the_ceiling_command_refuses_what_it_cannot_run(argv: list[str], message: str, capsys) -> None:
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err
