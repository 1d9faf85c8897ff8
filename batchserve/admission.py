"""Admission: a request as submitted (`Submission`, one record built once by whoever submits it:
the server's front end, `LLM`, a benchmark) checked and made a `Request` once, before the
scheduler sees it. Its id and tenant key, the server's limits, its prompt (tokenized, or its ids
checked against the vocabulary and the context), references, stop and bias ids, its constraint
compiled (or its compiled form copied), and a resumed generation's tokens made its output so
far. Every refusal is a ValueError that names the field."""

from __future__ import annotations

import hashlib
import itertools
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from batchserve.config import EngineConfig
from batchserve.grammar import CompiledGrammar, GrammarCompiler, RequestGrammar
from batchserve.request import Constraint, Request, SamplingParams
from batchserve.resume import check_resume
from batchserve.runner.build import ModelFacts
from batchserve.text import Prompt, TextCodec

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]+")  # nothing that could forge a log line or a header
NAMESPACE = re.compile(r"[0-9a-f]{12}")  # `id_namespace`'s


def id_namespace(tenant: str) -> str:
    """The namespace of a tenant's request ids (`Submission.namespace`): 12 hex digits of its
    SHA-256, so ids are unique per tenant and one tenant can neither see nor take another's."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:12]


def client_id(engine_id: str) -> str:
    """The id a client chose, from a namespaced engine id (`Submission.engine_id`); an id without
    a namespace as it is."""
    head, dot, tail = engine_id.rpartition(".")
    return head if dot and head and NAMESPACE.fullmatch(tail) else engine_id


@dataclass(frozen=True, slots=True)
class Submission:
    """One request as it is submitted, carried whole from the front end to `EngineCore.add_request`.

    `prompt`: text or token ids; `params`: sampling, lookahead options, stops, a constraint and a
    resumed generation's tokens (`SamplingParams`); `request_id`: unique among running requests
    (None: the engine names it); `tenant`: the isolation key whose drafts it shares (see
    DraftConfig.trie_scope) and whose share of the steps it counts in; `references`: texts or
    token ids its output is expected to repeat, drafted from privately; `group`: a key the samples
    of one call share (they compute the prompt's blocks once); `grammar`: `params.constraint`
    compiled ahead, off the event loop (the front end does): admission copies it instead of
    compiling (or finding) it on the loop. `namespace`: where `request_id` is unique (the server
    gives each tenant its own, `id_namespace`): the engine's id is then `<request_id>.<namespace>`."""

    prompt: Prompt
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    tenant: str = ""
    references: Sequence[Prompt] = ()
    group: str = ""
    grammar: CompiledGrammar | None = None
    namespace: str = ""

    @property
    def engine_id(self) -> str | None:
        """The request's id in the engine: its `request_id` within its namespace."""
        if self.request_id is None or not self.namespace:
            return self.request_id
        return f"{self.request_id}.{self.namespace}"


class Admission:
    """Builds an engine's requests: `request` validates and returns a `Request` to queue."""

    def __init__(self, config: EngineConfig, text: TextCodec, grammars: GrammarCompiler) -> None:
        self.config, self.text, self.grammars = config, text, grammars
        self._ids = itertools.count()

    def request(self, facts: ModelFacts, sub: Submission) -> Request:
        """The checked request for `facts`' model (see `EngineCore.add_request`)."""
        if not isinstance(sub, Submission):
            raise ValueError(f"submit a Submission, got {type(sub).__name__}")
        params = sub.params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        self._check_limits(params, sub.request_id, sub.tenant)
        # The prompt's ids (raises for a prompt beyond the context), its references', its stops in bounds.
        token_ids, reference_ids = self.text.inputs(sub.prompt, sub.references, params.stop, params.stop_token_ids)
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias])):
            if any(t >= facts.vocab_size for t in ids):
                raise ValueError(f"{name}: {max(ids)} is not a token id in [0, {facts.vocab_size})")
        req = Request(
            request_id=sub.engine_id if sub.request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=token_ids,
            params=params,
            eos_token_ids=facts.eos_token_ids,
            max_total_len=facts.max_model_len,
            arrival_time=time.monotonic(),
            tenant=sub.tenant,
            reference_token_ids=reference_ids,
            grammar=self._grammar(sub),
            group=sub.group,
        )
        check_resume(req, facts.vocab_size)  # a resumed generation's tokens become its output so far
        return req

    def compile(self, constraint: Constraint, tenant: str = "") -> CompiledGrammar:
        """`constraint` compiled (or found compiled by `tenant` before); thread-safe: front ends call
        it off the loop and hand the result in as `Submission.grammar`. ConstraintError, a
        ValueError, refuses it."""
        return self.grammars.compile(constraint, tenant)

    def check_constraint(self, constraint: Constraint) -> None:
        """Refuse a constraint over the size bound before anything is tokenized or compiled."""
        self.grammars.check_size(constraint)

    def _grammar(self, sub: Submission) -> RequestGrammar | None:
        """The request's own matcher: a copy of its compiled constraint (compiled here, or found in
        the cache, where the submitter did not compile it; ConstraintError, a ValueError, names the problem)."""
        constraint = sub.params.constraint
        if constraint is None:
            return None
        if sub.grammar is not None and sub.grammar.constraint != constraint:
            raise ValueError("grammar: compiled from another constraint than params.constraint")
        return self.grammars.matcher(sub.grammar or self.grammars.compile(constraint, sub.tenant))

    def check_tenant(self, tenant: str) -> None:
        """Raise ValueError unless `tenant` is "" (none) or a valid key."""
        if tenant:
            self._check_key("tenant", tenant)

    def _check_key(self, field_name: str, value: str) -> None:
        limit = self.config.limits.max_request_id_length
        if not value or len(value) > limit or not REQUEST_ID.fullmatch(value):
            raise ValueError(
                f"{field_name}: 1 to {limit} characters of A-Z a-z 0-9 . _ : - (got {len(value)} characters)"
            )

    def _check_limits(self, params: SamplingParams, request_id: str | None, tenant: str) -> None:
        if request_id is not None:
            self._check_key("request_id", request_id)
        self.check_tenant(tenant)
        cap = self.config.draft.decoding_length
        if params.decoding_length is not None and params.decoding_length > cap:
            raise ValueError(f"decoding_length: {params.decoding_length} is above the server's cap of {cap}")
