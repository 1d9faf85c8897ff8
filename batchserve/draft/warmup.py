"""A warm-up corpus for the trie: earlier outputs, one JSON object per line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from batchserve.jsonl import json_lines


def read_corpus(path: str | Path, tokenize: Callable[[str], list[int]] | None = None) -> list[list[int]]:
    """Token sequences from JSONL, one object per line with `token_ids` (list of ints) or `text`
    (needs `tokenize`); blank lines skipped; ValueError naming the line for anything else."""
    seqs: list[list[int]] = []
    for n, obj in json_lines(path):
        if isinstance(obj, dict) and isinstance(obj.get("token_ids"), list):
            seqs.append([int(t) for t in obj["token_ids"]])
        elif isinstance(obj, dict) and isinstance(obj.get("text"), str):
            if tokenize is None:
                raise ValueError(f"{path}: line {n}: text entries need a tokenizer")
            seqs.append(tokenize(obj["text"]))
        else:
            raise ValueError(f'{path}: line {n}: expected {{"token_ids": [...]}} or {{"text": "..."}}')
    return seqs
