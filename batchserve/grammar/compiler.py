"""Constraints compiled to llguidance matchers, validated, bounded and cached by their text.

Why llguidance: a token mask over SmolLM2's 49,152-token vocabulary in a small fraction of a
step with no start-up compile per grammar worth the name (measured: benchmarks/README.md), a
small wheel without dependencies, and the operations a draft tree needs: consume a token, roll
back, and the mask at any state. xgrammar would add triton and a TVM runtime to a CPU install, and
precompiles a grammar against the whole vocabulary before its first mask. Pure Python and
numpy around it; no torch.

What is cached is a pristine matcher, not only the grammar's text: building one constructs
llguidance's parser (36 ms for a 64k-character schema with SmolLM2's tokenizer), while a
request's matcher is a `deep_copy` of the cached one (10-40 us). Front ends compile in a thread
of their own and hold the result until their requests are in: a compiled grammar someone holds
is found by `compile` even after the cache let it go, so the event loop only ever copies.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batchserve.request import Constraint

# JSON as json.dumps writes it (", " and ": "), no other whitespace: what models emit by habit,
# and no run of newlines a model could loop in until max_new_tokens.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class ConstraintError(ValueError):
    """A constraint the engine refuses: not valid, or over a bound. The message names why."""


@dataclass(frozen=True)  # no slots: `GrammarCompiler` keeps weak references to the ones held
class CompiledGrammar:
    """A constraint as llguidance's serialized grammar and a matcher built from it, never
    advanced: each request gets a copy (`GrammarCompiler.matcher`)."""

    constraint: Constraint
    grammar: str
    pristine: Any = field(compare=False, repr=False)  # an llguidance.LLMatcher


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe (front ends compile off the event loop).

    `vocab_size`: the model's logit width. The grammar's end-of-sequence token is the tokenizer's
    (llguidance picks one for a tokenizer without): a request that chooses it ends there, and
    one whose grammar is complete ends without it (`RequestGrammar.done`).
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, max_chars: int, cache_size: int = 256, cache_chars: int | None = None
    ) -> None:
        """The cache keeps at most `cache_size` constraints and `cache_chars` characters of their
        specs (default 16 at the size limit): a cached matcher holds its parser, about 0.65 MB for
        a 64k-character schema (SmolLM2's tokenizer), so the count alone would let large ones
        take hundreds of MB."""
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_chars = max_chars
        self.cache_size = cache_size
        self.cache_chars = cache_chars if cache_chars is not None else 16 * max_chars
        self._cached_chars = 0
        self._lock = threading.Lock()
        self._lltokenizer: Any = None
        # Keyed by (scope, constraint): a tenant finds only what its own scope compiled, so how fast
        # its call starts says nothing of which schemas another tenant sent.
        self._cache: OrderedDict[tuple[str, Constraint], CompiledGrammar] = OrderedDict()
        # Every compiled grammar still referenced somewhere (a front end between compiling it and
        # submitting its requests), cached or not: found again, never built again.
        self._held: weakref.WeakValueDictionary[tuple[str, Constraint], CompiledGrammar] = weakref.WeakValueDictionary()
        self.num_builds = 0  # matchers built from a grammar (cache misses that compiled)

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

    def compile(self, constraint: Constraint, scope: str = "") -> CompiledGrammar:
        """The constraint's grammar and matcher, from the cache (or from whoever still holds
        them) when the same text was compiled before in `scope` (a tenant's). Raises
        ConstraintError for a constraint that is too long or invalid."""
        key = (scope, constraint)
        with self._lock:
            hit = self._cache.get(key) or self._held.get(key)
            if hit is not None:
                self._remember(key, hit)
                return hit
        self.check_size(constraint)
        compiled = self._build(constraint)
        with self._lock:
            self._remember(key, compiled)
        return compiled

    def _remember(self, key: tuple[str, Constraint], compiled: CompiledGrammar) -> None:
        """`compiled` the most recently used in the cache, the least recently used let go past
        its bounds (call with the lock held)."""
        if key in self._cache:
            self._cache.move_to_end(key)
            return
        self._cache[key] = self._held[key] = compiled
        self._cached_chars += len(key[1].spec)
        while len(self._cache) > self.cache_size or self._cached_chars > self.cache_chars:
            (_, evicted), _ = self._cache.popitem(last=False)
            self._cached_chars -= len(evicted.spec)

    def check_size(self, constraint: Constraint) -> None:
        """Raise ConstraintError for a constraint over the size limit (before any work on it)."""
        if len(constraint.spec) > self.max_chars:
            raise ConstraintError(
                f"the {constraint.kind} is {len(constraint.spec)} characters; the limit is {self.max_chars}"
            )

    def _build(self, c: Constraint) -> CompiledGrammar:
        """The grammar and its matcher (llguidance builds the parser without the GIL). Building
        the matcher also validates the grammar against the tokenizer: no second parser for that."""
        from llguidance import LLMatcher

        grammar = self._grammar(c)
        pristine = LLMatcher(self.lltokenizer, grammar, log_level=0)
        if pristine.is_error():
            raise ConstraintError(f"invalid {c.kind}: {(pristine.get_error() or 'refused by llguidance').strip()}")
        self._probe(c, pristine.deep_copy())
        with self._lock:
            self.num_builds += 1
        return CompiledGrammar(c, grammar, pristine)

    def _probe(self, c: Constraint, probe: Any) -> None:
        """Raise ConstraintError for a grammar whose first step fails (on `probe`, a copy): its first
        mask fails, allows no token but the end of a text not complete, or its first allowed token
        is refused (a schema that requires itself without end). Such a grammar would fail at the
        request's first step; the client hears it now, before anything is queued."""
        from batchserve.grammar.matcher import matcher_error

        first = np.frombuffer(probe.compute_bitmask(), dtype=np.uint8).copy()  # bit t of byte t // 8
        eos = self.eos_token_id
        if eos // 8 < len(first):
            first[eos // 8] &= ~(1 << (eos % 8)) & 0xFF
        allowed = np.flatnonzero(np.unpackbits(first, bitorder="little"))
        if not probe.is_error() and len(allowed):
            probe.consume_token(int(allowed[0]))
        if probe.is_error() or (not len(allowed) and not probe.is_accepting()):
            reason = matcher_error(probe) if probe.is_error() else "no token can begin its text"
            raise ConstraintError(f"the {c.kind} admits no text: {reason}")

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
        return grammar

    def matcher(self, compiled: CompiledGrammar) -> Any:
        """A fresh matcher for one request (`RequestGrammar`): a copy of the compiled one, so the
        parser is never built again for it."""
        from batchserve.grammar.matcher import RequestGrammar

        return RequestGrammar(compiled.pristine.deep_copy(), self.eos_token_id, self.vocab_size)
