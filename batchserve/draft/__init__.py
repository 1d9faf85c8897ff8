"""Draft sources (pure Python: no torch, no grpc)."""

from batchserve.config import DraftConfig
from batchserve.draft.base import Drafter, NoDrafter
from batchserve.draft.llma import SingleBranchDrafter
from batchserve.draft.tree import DraftTree
from batchserve.draft.trie import TrieDrafter

__all__ = ["DraftTree", "Drafter", "NoDrafter", "SingleBranchDrafter", "TrieDrafter", "make_drafter"]


def make_drafter(config: DraftConfig) -> Drafter:
    """Build the drafter a `DraftConfig` names."""
    if config.method == "none":
        return NoDrafter()
    if config.method == "llma":
        return SingleBranchDrafter(max_match=config.max_match, min_match=config.min_match)
    if config.method == "lookahead":
        return TrieDrafter(config)
    raise ValueError(f"unknown draft method {config.method!r}")
