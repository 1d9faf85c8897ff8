"""A GGUF file's tokenizer made to split text as llama.cpp splits it (`src/llama-vocab.cpp`).

transformers builds the tokenizer from the file's vocabulary and merges, but not its splitting
rules: a SentencePiece vocabulary (Llama 2, Mistral) drops a leading space that llama.cpp keeps
(' Hello' is [29871, 15043] there, [15043] here), and a BPE vocabulary gets one generic regex
where llama.cpp picks the regexes of its `tokenizer.ggml.pre` type (digits alone or by threes,
CJK runs, punctuation) and, for some types, takes a whole piece that is in the vocabulary as one
token before any merge (`ignore_merges`). `match_llama_cpp` sets those rules on the tokenizer's
backend: the same vocabulary, merges and special tokens, llama.cpp's pieces.

The regexes are llama.cpp's, applied in order (each splits the pieces the previous one left, as
`unicode_regex_split` does). A pre type not in PRE_TYPES keeps transformers' rules, with a warning.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("batchserve")

_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK = "[一-龥ࠀ-一가-퟿]+"
_DEEPSEEK_PUNCT = r"\s?[!-/:-~！-／：-～‘-‟　-。]+"
_DEEPSEEK_LETTERS = (  # the letters of llama.cpp's list, escaped (NFC would fold some range ends)
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-"
    "\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107"
    "\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
    "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"
)


@dataclass(frozen=True, slots=True)
class PreType:
    """llama.cpp's splitting of one `tokenizer.ggml.pre` family."""

    regexes: tuple[str, ...]  # applied in order, each piece it matches kept apart from the rest
    ignore_merges: bool = False  # a piece that is a vocabulary entry is one token, merges or not


_LLAMA3_TYPE = PreType((_LLAMA3,), ignore_merges=True)
_STARCODER_TYPE = PreType((r"\p{N}", _GPT2))
_GPT2_TYPE = PreType((_GPT2,))
_QWEN2_TYPE = PreType((_QWEN2,))
PRE_TYPES: dict[str, PreType] = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2"), _LLAMA3_TYPE),
    **dict.fromkeys(("dbrx", "smaug-bpe", "chatglm-bpe"), PreType((_LLAMA3,))),
    "deepseek-llm": PreType((r"[\r\n]", _DEEPSEEK_LETTERS, _DEEPSEEK_PUNCT, r"\s+$", _CJK, r"\p{N}+")),
    "deepseek-coder": PreType((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
    "falcon": PreType((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"), _STARCODER_TYPE
    ),
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "mellum"), _GPT2_TYPE),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "hunyuan", "kormo"), _QWEN2_TYPE),
    "qwen35": PreType((_QWEN35,)),
}
SPIECE = "\u2581"  # SentencePiece's space


def _value(metadata: Mapping[str, Any], key: str, default: Any = None) -> Any:
    entry = metadata.get(key)
    return default if entry is None else getattr(entry, "value", entry)


def match_llama_cpp(tokenizer: Any, metadata: Mapping[str, Any]) -> str:
    """Set llama.cpp's splitting rules for the file's vocabulary on `tokenizer` (a transformers fast
    tokenizer built from the same file), in place; what was set, for the log."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return "a tokenizer without a tokenizers backend: left as built"
    model = _value(metadata, "tokenizer.ggml.model")
    if model == "llama":
        return _sentencepiece(backend, bool(_value(metadata, "tokenizer.ggml.add_space_prefix", True)))
    if model == "gpt2":
        pre = str(_value(metadata, "tokenizer.ggml.pre", "default"))
        kind = PRE_TYPES.get(pre)
        if kind is None:
            logger.warning("tokenizer: llama.cpp's pre-tokenizer %r is not among ours: transformers' rules kept", pre)
            return f"pre-tokenizer {pre}: transformers' rules"
        _byte_level(backend, kind)
        return f"pre-tokenizer {pre}: llama.cpp's {len(kind.regexes)} regexes" + (
            ", whole vocabulary pieces first" if kind.ignore_merges else ""
        )
    return f"vocabulary {model}: left as built"


def _sentencepiece(backend: Any, space_prefix: bool) -> str:
    """llama.cpp's SentencePiece input: a space before the text (and after each special token),
    every space a SentencePiece space, no other splitting."""
    from tokenizers import normalizers

    steps = [normalizers.Prepend(SPIECE)] if space_prefix else []
    backend.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", SPIECE)])
    backend.pre_tokenizer = None
    return "SentencePiece: " + ("a space before the text, " if space_prefix else "") + "spaces as \u2581"


def _byte_level(backend: Any, kind: PreType) -> None:
    from tokenizers import Regex, Tokenizer, pre_tokenizers

    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in kind.regexes]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    backend.normalizer = None
    if kind.ignore_merges:  # a model option: set through the serialized form, the same vocabulary and merges
        state = json.loads(backend.to_str())
        if state["model"].get("type") == "BPE" and not state["model"].get("ignore_merges"):
            state["model"]["ignore_merges"] = True
            rebuilt = Tokenizer.from_str(json.dumps(state))
            backend.model = rebuilt.model
