"""What a GGUF file's vocabulary says beyond the tokenizer transformers builds from it: the ids
that end a generation, as llama.cpp reads them (`llama_vocab::impl::load`, its EOG set)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

# Token texts llama.cpp takes as ending a generation wherever a vocabulary holds them (chat turns'
# ends, tool calls' ends, end of text), besides the ids the metadata names.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",
})  # fmt: skip
# Metadata keys whose id ends a generation: eos, end of turn, end of message, and the fill-in-the-
# middle pad / repo / separator tokens (llama.cpp stops on those too).
EOG_KEYS = tuple(f"tokenizer.ggml.{name}_token_id" for name in ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep"))


def end_of_generation_ids(metadata: Mapping[str, Any]) -> frozenset[int]:
    """The ids that end a generation in llama.cpp for a file's metadata (key -> `MetaValue` or a
    plain value): every id the EOG keys name, and every token whose text is in EOG_TEXTS. Where the
    vocabulary has `<|return|>` and `<|call|>` (or `<|calls|>` and `<|flush|>`: gpt-oss, solar),
    `<|end|>` ends a message, not the generation, and is left out, as llama.cpp leaves it."""

    def value(key: str) -> Any:
        entry = metadata.get(key)
        return getattr(entry, "value", entry)

    tokens = value("tokenizer.ggml.tokens") or []
    ids = {int(v) for v in map(value, EOG_KEYS) if v is not None and int(v) >= 0}
    by_text = {text: i for i, text in enumerate(tokens) if text in EOG_TEXTS}
    ids.update(by_text.values())
    present = set(by_text)
    if "<|end|>" in present and ({"<|return|>", "<|call|>"} <= present or {"<|calls|>", "<|flush|>"} <= present):
        ids.discard(by_text["<|end|>"])
    return frozenset(ids)


def file_end_of_generation_ids(path: str | Path) -> frozenset[int]:
    """`end_of_generation_ids` of the GGUF file at `path` (its header only)."""
    from batchserve.model.gguf_read import read_gguf

    return end_of_generation_ids(read_gguf(path).metadata)
