"""Constraints compiled to llguidance grammars, validated, bounded and cached by their text.

Why llguidance: a token mask over SmolLM2's 49,152-token vocabulary in a small fraction of a
step with no start-up compile per grammar worth the name (measured: benchmarks/README.md), a
small wheel without dependencies, and the operations a draft tree needs: consume a token, roll
back, and the mask at any state. xgrammar would add triton and a TVM runtime to a CPU install, and
precompiles a grammar against the whole vocabulary before its first mask. Pure Python and
numpy around it; no torch.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from batchserve.request import Constraint

# JSON as json.dumps writes it (", " and ": "), no other whitespace: what models emit by habit,
# and no run of newlines a model could loop in until max_new_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A constraint the engine refuses: not valid, or over a bound. The message names why."""


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    """A constraint as llguidance's serialized grammar, validated against the tokenizer."""

    constraint: Constraint
    grammar: str


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe (front ends compile off the event loop).

    `vocab_size`: the model's logit width. The grammar's end-of-sequence token is the tokenizer's
    (llguidance picks one for a tokenizer without): a request that chooses it ends there, and
    one whose grammar is complete ends without it (`RequestGrammar.done`).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_chars: int, cache_size: int = 256) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_chars = max_chars
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._lltokenizer: Any = None
        self._cache: OrderedDict[Constraint, CompiledGrammar] = OrderedDict()

    @property
    def lltokenizer(self) -> Any:
        """llguidance's view of the tokenizer (about 0.6 s to build for a 49k vocabulary: once)."""
        with self._lock:
            if self._lltokenizer is None:
                import llguidance.hf

                eos = getattr(self._hf_tokenizer, "eos_token_id", None)  # None: llguidance picks one
                n_vocab = max(self.vocab_size, len(self._hf_tokenizer))
                self._lltokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=n_vocab, eos_token=eos)
            return self._lltokenizer

    @property
    def eos_token_id(self) -> int:
        return int(self.lltokenizer.eos_token)

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """The constraint's grammar, from the cache when the same text was compiled before.
        Raises ConstraintError for a constraint that is too long or invalid."""
        with self._lock:
            hit = self._cache.get(constraint)
            if hit is not None:
                self._cache.move_to_end(constraint)
                return hit
        if len(constraint.spec) > self.max_chars:
            raise ConstraintError(
                f"the {constraint.kind} is {len(constraint.spec)} characters; the limit is {self.max_chars}"
            )
        compiled = CompiledGrammar(constraint, self._grammar(constraint))
        with self._lock:
            self._cache[constraint] = compiled
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _grammar(self, c: Constraint) -> str:
        from llguidance import LLMatcher

        try:
            if c.kind == "json_object":
                grammar = LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
            elif c.kind == "json_schema":
                schema = json.loads(c.spec)
                if not isinstance(schema, dict | bool):
                    raise ConstraintError("a JSON schema must be a JSON object")
                grammar = LLMatcher.grammar_from_json_schema(schema, JSON_OPTIONS)
            elif c.kind == "regex":
                grammar = LLMatcher.grammar_from_regex(c.spec)
            else:
                grammar = LLMatcher.grammar_from_lark(c.spec)
        except (ValueError, TypeError, RecursionError) as e:  # json.JSONDecodeError is a ValueError
            raise ConstraintError(f"invalid {c.kind}: {e}") from None
        error = LLMatcher.validate_grammar(grammar, self.lltokenizer)
        if error:
            raise ConstraintError(f"invalid {c.kind}: {error.strip()}")
        return grammar

    def matcher(self, compiled: CompiledGrammar) -> Any:
        """A fresh matcher for one request (`RequestGrammar`)."""
        from llguidance import LLMatcher

        from batchserve.grammar.matcher import RequestGrammar

        tokenizer = self.lltokenizer
        return RequestGrammar(LLMatcher(tokenizer, compiled.grammar), int(tokenizer.eos_token), self.vocab_size)
