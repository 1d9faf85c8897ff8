"""Admission: a request checked and built once, before the scheduler sees it. Its id and tenant
key, the server's limits, its prompt (tokenized, or its ids checked against the vocabulary and
the context), references, stop and bias ids, its constraint compiled (or found compiled) and
copied, and a resumed generation's tokens made its output so far. Every refusal is a ValueError
that names the field."""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Sequence

from batchserve.config import EngineConfig
from batchserve.grammar import GrammarCompiler
from batchserve.request import Request, SamplingParams
from batchserve.resume import check_resume
from batchserve.runner.build import ModelFacts
from batchserve.text import Prompt, TextCodec

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]+")  # nothing that could forge a log line or a header


class Admission:
    """Builds an engine's requests: `request` validates and returns a `Request` to queue."""

    def __init__(self, config: EngineConfig, text: TextCodec, grammars: GrammarCompiler) -> None:
        self.config, self.text, self.grammars = config, text, grammars
        self._ids = itertools.count()

    def request(
        self,
        facts: ModelFacts,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        tenant: str = "",
        references: Sequence[Prompt] = (),
        group: str = "",
    ) -> Request:
        """The checked request for `facts`' model (see `EngineCore.add_request`)."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        self._check_limits(params, request_id, tenant)
        token_ids = self.text.tokenize(prompt)  # raises for a prompt beyond the context
        if not token_ids:
            raise ValueError("prompt is empty")
        reference_ids = self.text.tokenize_references(references)
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias])):
            if any(t >= facts.vocab_size for t in ids):
                raise ValueError(f"{name}: {max(ids)} is not a token id in [0, {facts.vocab_size})")
        # A constraint is compiled (or found in the cache) first: ConstraintError, a ValueError, names the problem.
        grammar = self.grammars.matcher(self.grammars.compile(params.constraint)) if params.constraint else None
        req = Request(
            request_id=request_id if request_id is not None else f"req-{next(self._ids)}",
            prompt_token_ids=token_ids,
            params=params,
            eos_token_ids=facts.eos_token_ids,
            max_total_len=facts.max_model_len,
            arrival_time=time.monotonic(),
            tenant=tenant,
            reference_token_ids=reference_ids,
            grammar=grammar,
            group=group,
        )
        check_resume(req, facts.vocab_size)  # a resumed generation's tokens become its output so far
        return req

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
        self.text.check_stop(params.stop, params.stop_token_ids)
        cap = self.config.draft.decoding_length
        if params.decoding_length is not None and params.decoding_length > cap:
            raise ValueError(f"decoding_length: {params.decoding_length} is above the server's cap of {cap}")
