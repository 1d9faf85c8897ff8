"""Resumed generations: a request that carries the tokens already generated for it (on a replica
that failed) continues as if this engine had produced them.

Output is a function of the request alone (greedy, or the k-th uniform of its own seeded stream
for its k-th token; on CPU the forward is batch-invariant bit for bit), so the continuation is
what the uninterrupted generation would have been. Here: the tokens are the request's output
before its first step (the prompt and they are prefilled as one chunk, as a preempted request's
are recomputed; the prefix cache makes a warm resume cheap), its grammar is advanced through
them, its text decoded past them (`Detokenizer.begin`) (and what the interrupted stream had handed out marked sent),
the drafter learns them, and the runner starts its seeded stream after them. max_new_tokens,
stop strings and penalties count the whole output; logprobs come for the new tokens only.

A resume that the interrupted generation could not have reached is refused (ValueError, naming
`resume_token_ids`): a token outside the vocabulary, one the grammar forbids, or an end (EOS, a
stop token or string, the grammar's end, whose end of sequence ends it even with `ignore_eos`,
the context) inside the resumed tokens. The count is bounded before any token is copied.

Resumed tokens are input the client sent: they count in the output (`completion_tokens`, as the
uninterrupted generation's would) and on their own (`RequestStats.resumed_tokens`, reported as
usage's `resumed_tokens`), so a gateway can count them with the prompt against an input limit.
"""

from __future__ import annotations

from typing import Any

from batchserve.request import Request


def check_resume(req: Request, vocab_size: int) -> None:
    """Make `req` a resumed request (its output is `params.resume_token_ids`), before the
    scheduler sees it; raise ValueError where the tokens could not be its output so far. The
    length is checked before any token is read or copied; the scan is at C speed but for an
    error, which it then locates."""
    tokens = req.params.resume_token_ids
    if not tokens:
        return
    p = req.params
    if req.num_prompt_tokens + len(tokens) >= req.max_total_len:
        raise ValueError(
            f"resume_token_ids: the prompt's {req.num_prompt_tokens} tokens and {len(tokens)} resumed fill the "
            f"model's context of {req.max_total_len}"
        )
    ends = p.stop_token_set if p.ignore_eos else p.stop_token_set | req.eos_token_ids
    if max(tokens) >= vocab_size or not ends.isdisjoint(tokens):
        for i, t in enumerate(tokens):
            if t >= vocab_size:
                raise ValueError(f"resume_token_ids[{i}]: {t} is not a token id in [0, {vocab_size})")
            if t in ends:
                raise ValueError(f"resume_token_ids[{i}]: {t} ends the generation (end of sequence or a stop token)")
    if req.grammar is not None:
        _advance_grammar(req.grammar, tokens)
    req.output_token_ids = list(tokens)
    req.all_token_ids = req.prompt_token_ids + req.output_token_ids
    req.stats.resumed_tokens = len(tokens)


def _advance_grammar(grammar: Any, tokens: tuple[int, ...]) -> None:
    """The grammar through the tokens, refusing each as it would a generated one: its end of
    sequence ends the text whatever `ignore_eos` says, so one inside them is refused too."""
    from batchserve.grammar.matcher import GrammarError

    for i, t in enumerate(tokens):
        if grammar.done:
            raise ValueError(f"resume_token_ids[{i}]: the structured output was already complete before it")
        try:
            grammar.commit([t])
        except GrammarError as e:
            raise ValueError(f"resume_token_ids[{i}]: the structured output forbids token {t} ({e})") from None
