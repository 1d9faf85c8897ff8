"""The draft source speculation owns: the drafter a `DraftConfig` names, built and warmed once,
and corpora loaded into its trie while serving. The engine reaches the drafter only through
speculation (`Speculation.drafter`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from batchserve.config import DraftConfig
from batchserve.draft import Drafter, TrieDrafter, make_drafter
from batchserve.draft.base import LearnsLater

logger = logging.getLogger("batchserve")


def build_drafter(config: DraftConfig, tokenize: Callable[[str], list[int]], deferred: bool) -> Drafter:
    """The configured drafter, its trie warmed from `config.warmup_path` where one is named.
    `deferred`: insertion waits for `Speculation.learn`, beside the next forward (on a device;
    on a CPU it runs at once: benchmarks/README.md)."""
    drafter = make_drafter(config)
    if isinstance(drafter, TrieDrafter) and config.warmup_path:
        n = drafter.warm_up_file(config.warmup_path, tokenize, config.warmup_scope)
        msg = "warmed the lookahead trie (scope %r) with %d sequences from %s"
        logger.info(msg, config.warmup_scope, n, config.warmup_path)
    defer(drafter, deferred)
    return drafter


def defer(drafter: Drafter, deferred: bool) -> None:
    """Defer a drafter's insertions to `learn` where it can and `deferred` asks for it."""
    if deferred and isinstance(drafter, LearnsLater):
        drafter.defer_learning()


def corpus_slices(
    drafter: Drafter, config: DraftConfig, sequences: list[list[int]], tenant: str, slice_tokens: int
) -> Iterator[None]:
    """Load earlier outputs into the trie of `tenant`'s scope a slice of `slice_tokens` run starts
    at a time (the returned iterator does the work). Raises ValueError at once where no trie is
    shared (another drafter, or `trie_scope=request`)."""
    if not isinstance(drafter, TrieDrafter):
        raise ValueError(f"the {config.method!r} drafter has no trie to add a corpus to")
    scope = {"global": "", "tenant": tenant}.get(config.trie_scope)
    if scope is None:
        raise ValueError("trie_scope 'request' shares no n-grams between requests: a corpus would serve none")
    return drafter.warm_up_slices(sequences, scope, slice_tokens)
