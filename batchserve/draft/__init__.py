"""Draft sources (pure Python: no torch, no grpc)."""

from batchserve.config import DraftConfig
from batchserve.draft.base import Drafter, NoDrafter, WindowDrafter
from batchserve.draft.jacobi import HybridDrafter, JacobiDrafter
from batchserve.draft.llma import SingleBranchDrafter
from batchserve.draft.trie import TrieDrafter
from batchserve.trees import DraftTree, WindowRows

__all__ = [
    "DraftTree",
    "Drafter",
    "HybridDrafter",
    "JacobiDrafter",
    "NoDrafter",
    "SingleBranchDrafter",
    "TrieDrafter",
    "WindowDrafter",
    "WindowRows",
    "make_drafter",
]


def make_drafter(config: DraftConfig) -> Drafter:
    """Build the drafter a `DraftConfig` names."""
    if config.method == "none":
        return NoDrafter()
    if config.method == "llma":
        return SingleBranchDrafter(max_match=config.max_match, min_match=config.min_match)
    if config.method == "lookahead":
        return TrieDrafter(config)
    if config.method == "jacobi":
        return JacobiDrafter(config)
    if config.method == "hybrid":
        return HybridDrafter(config)
    raise ValueError(f"unknown draft method {config.method!r}")
