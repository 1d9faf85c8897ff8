"""What a step verifies for a request beyond its committed tokens, as data: draft trees
(`tree.py`: `DraftTree`, the ancestor masks) and Jacobi windows (`WindowRows`), with the masks
the attention reads, and how trees are built, merged and walked (`build.py`). Drafters build them
(`draft/`); the scheduler, the runner, the attention and the grammar read them without knowing
any drafter. numpy only."""

from batchserve.trees.build import TreeBuilder, merge_into, merge_trees, walk
from batchserve.trees.tree import (
    MATCH_CAP,
    DraftTree,
    WindowRows,
    ancestor_mask,
    spec_mask,
    window_layout,
    window_rows,
)

__all__ = [
    "MATCH_CAP",
    "DraftTree",
    "TreeBuilder",
    "WindowRows",
    "ancestor_mask",
    "merge_into",
    "merge_trees",
    "spec_mask",
    "walk",
    "window_layout",
    "window_rows",
]
