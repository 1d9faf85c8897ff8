"""Draft sources (pure Python: no torch, no grpc)."""

from batchserve.draft.base import Drafter, NoDrafter
from batchserve.draft.llma import SingleBranchDrafter
from batchserve.draft.tree import DraftTree

__all__ = ["DraftTree", "Drafter", "NoDrafter", "SingleBranchDrafter", "make_drafter"]


def make_drafter(method: str, max_match: int = 8, min_match: int = 1) -> Drafter:
    """Build the drafter a `DraftConfig.method` names."""
    if method == "none":
        return NoDrafter()
    if method == "llma":
        return SingleBranchDrafter(max_match=max_match, min_match=min_match)
    raise ValueError(f"unknown draft method {method!r}")
