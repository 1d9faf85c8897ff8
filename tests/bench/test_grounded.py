"""Input-grounded workloads (code-edit, doc-qa, summarize) and a user's own JSONL prompts."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from batchserve.bench.datasets import DatasetError, jsonl, load_samples, split, split_workload
from batchserve.bench.grounded import (
    EDITS,
    MAX_CHARS,
    MIN_CHARS,
    code_edit,
    doc_passages,
    doc_qa,
    rename,
    rename_target,
    summarize,
)
from batchserve.cli import main


def _code(sample_prompt: str) -> str:
    return sample_prompt.split("```python\n", 1)[1].rsplit("\n```", 1)[0]


def test_code_edit_takes_standard_library_code_with_every_kind_of_edit() -> None:
    samples = code_edit(80)
    assert len(samples) == 80 and len({s.id for s in samples}) == 80
    assert code_edit(80) == samples  # deterministic
    kinds = {s.id.rsplit("/", 1)[1] for s in samples}
    assert kinds == {e for e, _ in EDITS}
    modules = {s.id.split(".", 1)[0] for s in samples}
    assert len(modules) >= 40  # round-robin across files: no module dominates
    for s in samples:
        code = _code(s.prompt)
        ast.parse(code)  # a whole function or class, as the file has it
        assert s.chat and 6 <= code.count("\n") + 1 <= 40
        # The answer repeats most of the input: what makes the workload input-grounded.
        assert _code(s.reference).count("\n") == code.count("\n")


def test_rename_changes_the_identifier_and_nothing_else() -> None:
    code = (
        'def f(value, other):\n    """value stays in strings"""\n    # value in a comment\n    return value + other\n'
    )
    assert rename_target(code) == "value"
    out = rename(code, "value", "value_renamed")
    assert out == (
        'def f(value_renamed, other):\n    """value stays in strings"""\n    # value in a comment\n'
        "    return value_renamed + other\n"
    )
    renamed = [s for s in code_edit(40) if s.id.endswith("/rename")]
    assert renamed
    for s in renamed:
        old = s.prompt.split("`", 2)[1]
        assert f"{old}_renamed" in s.reference and ast.parse(_code(s.reference))


def test_doc_passages_are_bounded_sections_of_the_shipped_documentation() -> None:
    passages = doc_passages()
    assert len(passages) >= 100
    assert all(MIN_CHARS <= len(p) <= MAX_CHARS for _, p in passages)
    assert len({t for t, _ in passages}) >= 50
    qa, summ = doc_qa(60), summarize(60)
    assert len(qa) == len(summ) == 60
    for q, s, (topic, passage) in zip(qa, summ, passages):
        assert passage in q.prompt and passage in s.prompt
        assert topic in q.prompt.rsplit("\n\n", 1)[1]  # the question names the section's subject
        assert q.reference and q.reference in passage  # the grounded answer's stand-in comes from it


def test_named_workloads_keep_the_dev_test_split() -> None:
    for name in ("code-edit", "doc-qa", "summarize"):
        samples = load_samples(name, 20)
        dev, test = split_workload(name, samples)
        assert (dev, test) == split(samples) and len(test) == 10


def _write(tmp_path: Path, lines: list[object]) -> Path:
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    return path


def test_jsonl_reads_text_and_chat_prompts(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            {"prompt": "def add(a, b):", "id": "p1"},
            "",
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello"},
                    {"role": "user", "content": "Fix this code"},
                ],
                "prediction": "the code",
            },
        ],
    )
    a, b = jsonl(path)
    assert (a.id, a.prompt, a.chat) == ("p1", "def add(a, b):", False)
    assert b.chat and b.prompt == "Fix this code" and b.prediction == "the code"
    assert [m["role"] for m in b.messages()] == ["system", "user", "assistant", "user"]
    # No references: nothing to warm with, so every line is measured.
    assert split_workload(str(path), [a, b]) == ([], [a, b])
    with_ref = [a, b.__class__(b.id, b.prompt, "an answer", True)]
    assert split_workload(str(path), with_ref) == split(with_ref)
    assert len(jsonl(path, limit=1)) == 1


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "line 1: not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"id": 3}, 'exactly one of "prompt"'),
        ({"prompt": "a", "messages": []}, 'exactly one of "prompt"'),
        ({"prompt": ""}, "non-empty string"),
        ({"messages": []}, "non-empty list"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role in"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "the user's"),
        ({"prompt": "x", "prediction": 5}, "must be strings"),
    ],
)
def test_jsonl_names_the_line_and_the_problem(tmp_path: Path, line: object, problem: str) -> None:
    path = _write(tmp_path, [line])
    with pytest.raises(DatasetError, match=problem):
        jsonl(path)


def test_jsonl_without_prompts_or_unreadable_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DatasetError, match="no prompts"):
        jsonl(empty)
    with pytest.raises(DatasetError, match="cannot read"):
        jsonl(tmp_path / "missing.jsonl")


def test_bench_cli_refuses_a_bad_workload_before_loading_models(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = _write(tmp_path, [{"prompt": "ok"}, {"text": "no prompt"}])
    assert main(["bench", "--dataset", str(bad), "--methods", "none"]) == 2
    assert "line 2" in capsys.readouterr().err
    assert main(["bench", "--dataset", str(tmp_path / "nope.jsonl"), "--methods", "none"]) == 2
    assert "unknown dataset" in capsys.readouterr().err


def test_repeat_sends_each_test_prompt_twice_in_two_rounds() -> None:
    from batchserve.bench.runs import load_dataset
    from batchserve.runner import load_tokenizer

    tok = load_tokenizer(None)
    once, twice = load_dataset("doc-qa", 3, tok), load_dataset("doc-qa+repeat", 6, tok)
    assert twice.prompts == once.prompts + once.prompts and twice.warm == once.warm
    assert load_dataset("doc-qa+repeat", 5, tok).prompts == once.prompts + once.prompts[:2]
    assert main(["bench", "--dataset", "doc-qa+repeat", "--num-prompts", "0"]) == 2  # known, the count refused


def test_exact_repeats_run_after_the_first_round_and_draft_from_its_outputs(tiny_tokenizer: Any) -> None:
    from batchserve.bench.methods import batchserve_method, make_row
    from batchserve.bench.report import _repeat_rounds
    from batchserve.bench.runs import rounds_of, run_batchserve
    from tests.conftest import make_ascii_model

    a, b = [5, 6, 7], [9, 8]
    assert rounds_of([a, b, a, b]) == [slice(0, 2), slice(2, None)]
    assert rounds_of([a, b, b, a]) == [slice(0, 4)] and rounds_of([a, b, a]) == [slice(0, 3)]
    prompts = [[5 + (i * 7 + j) % 60 for j in range(10)] for i in range(3)]
    model = make_ascii_model()
    m = batchserve_method("lookahead")
    once = run_batchserve(model, tiny_tokenizer, prompts, 16, 3, m, [], 8)
    twice = run_batchserve(model, tiny_tokenizer, prompts + prompts, 16, 3, m, [], 8)
    assert once.second_round_tokens_per_step is None and twice.outputs == once.outputs + once.outputs
    # The second round's requests start after the first's have finished: all their drafts are known.
    assert twice.second_round_tokens_per_step > 2 * once.tokens_per_step
    row = make_row("lookahead", "x+repeat", 3, twice.outputs, 1.0, [0.1], [0.1], twice.tokens_per_step, True)
    row.repeat_tokens_per_step = twice.second_round_tokens_per_step
    assert f"lookahead b=3: {row.repeat_tokens_per_step:.2f}" in _repeat_rounds([row])[0]


def test_prediction_methods_send_each_samples_prediction(tiny_tokenizer: Any) -> None:
    from batchserve.bench.methods import batchserve_method, known_method, method_rank
    from batchserve.bench.runs import run_batchserve
    from tests.conftest import make_ascii_model

    assert all(s.prediction == f"```python\n{_code(s.prompt)}\n```" for s in code_edit(8))
    m = batchserve_method("lookahead+prediction")
    assert m is not None and m.predicted and m.prefix_caching and not batchserve_method("lookahead").predicted
    both = batchserve_method("none+prediction+nocache")
    assert both is not None and both.predicted and not both.prefix_caching
    assert known_method("none-gguf+prediction") and not known_method("hf+prediction")
    assert method_rank("lookahead") < method_rank("lookahead+prediction") < method_rank("lookahead-4")
    # A prediction that is the greedy output itself: fewer steps, the same tokens.
    prompts = [[5 + (i * 7 + j) % 60 for j in range(10)] for i in range(2)]
    model = make_ascii_model()  # its output is text that tokenizes back to the same ids
    plain = run_batchserve(model, tiny_tokenizer, prompts, 12, 2, batchserve_method("none"), [], 8)
    texts = [tiny_tokenizer.decode(o) for o in plain.outputs]
    assert all(tiny_tokenizer(t, add_special_tokens=False).input_ids == o for t, o in zip(texts, plain.outputs))
    told = run_batchserve(model, tiny_tokenizer, prompts, 12, 2, m, [], 8, predictions=texts)
    assert told.outputs == plain.outputs and told.tokens_per_step > 2 * plain.tokens_per_step


def test_json_extract_pairs_each_passage_with_a_schema_its_reference_answer_matches():
    from batchserve.bench.grounded import SCHEMAS, json_extract
    from batchserve.grammar import GrammarCompiler
    from batchserve.request import Constraint
    from tests.conftest import TINY_VOCAB, make_tiny_tokenizer

    samples = json_extract(30)
    assert len(samples) == 30 and samples == json_extract(30)  # deterministic
    compiler = GrammarCompiler(make_tiny_tokenizer(), TINY_VOCAB, max_chars=10_000)
    kinds = set()
    for s in samples:
        schema = json.loads(s.constraint)
        kinds.add(tuple(schema["properties"]))
        assert s.chat and s.constraint in s.prompt and schema["required"] == list(schema["properties"])
        # The reference (the dev split's warm-up output) is itself a document the schema accepts.
        grammar = compiler.matcher(compiler.compile(Constraint("json_schema", s.constraint)))
        grammar.commit(list(s.reference.encode()))
        assert grammar.done, s.reference
    assert len(kinds) == len(SCHEMAS)


def test_a_constrained_workload_runs_lossless_against_its_own_plain_decoding(tiny_tokenizer):
    from batchserve.bench.methods import batchserve_method, expected_outputs
    from batchserve.bench.runs import run_batchserve
    from tests.conftest import make_ascii_model

    model = make_ascii_model()
    schema = json.dumps(
        {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}}, "required": ["a"], "additionalProperties": False}
    )
    prompts = [list(b"one"), list(b"two"), list(b"three")]
    constraints = [schema, "", schema]
    own: dict = {}
    runs = {}
    for name in ("none", "lookahead"):
        m = batchserve_method(name)
        run = run_batchserve(model, tiny_tokenizer, prompts, 30, 2, m, [], 8, None, constraints=constraints)
        runs[name] = run.outputs
        expected = expected_outputs(name, m.cpu_weights, [], own, ("d", 2, None), run.outputs, constrained=True)
        assert expected is None if name == "none" else expected == runs["none"]
    for out, c in zip(runs["none"], constraints):
        text = bytes(out).decode()
        assert (json.loads(text) in ({"a": "x"}, {"a": "yy"})) if c else len(out) == 30
