"""Structured output: constraints (JSON, JSON Schema, regex, Lark) compiled by llguidance, and
per request, the draft nodes a grammar allows and the token mask of every verified row."""

from batchserve.grammar.compiler import CompiledGrammar, ConstraintError, GrammarCompiler
from batchserve.grammar.matcher import GrammarError, RequestGrammar, allows

__all__ = ["CompiledGrammar", "ConstraintError", "GrammarCompiler", "GrammarError", "RequestGrammar", "allows"]
