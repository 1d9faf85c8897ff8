"""Speculation: which drafts each step verifies, and what the outcomes teach.

`Speculation` (`planner.py`) is the one object the engine owns: each step it proposes drafts as
data (`StepDrafts`, whose slots the scheduler reserves) and learns from the committed step
(`CommittedDraft`s). Its draft source (`sources.py`) is built from the config. Behind it: the
draft budget policy (`budget.py`: adaptive decoding length) over the device's measured cost
profile (`batchserve/cost_profile.py`), acceptance tracking (`acceptance.py`, `fits.py`), the judging of trees by
later tokens (`judging.py`), the speed guard (`speed_guard.py`), speculation's host time
(`host_budget.py`) and the policy's own drafts (`policy_drafts.py`). Pure Python and numpy:
no torch, no gRPC.
"""

from batchserve.draft.base import Drafter
from batchserve.speculation.budget import DraftBudgetPolicy
from batchserve.speculation.planner import Speculation
from batchserve.speculation.sources import build_drafter, corpus_slices, defer

# `Drafter` is the protocol speculation drafts through: whoever hands in a drafter of their own
# (`EngineCore`, `LLM`) names its type here.
__all__ = ["DraftBudgetPolicy", "Drafter", "Speculation", "build_drafter", "corpus_slices", "defer"]
