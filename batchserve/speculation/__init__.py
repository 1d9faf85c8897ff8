"""Speculation: which drafts each step verifies, and what the outcomes teach.

`DraftPlanner` (`planner.py`) is the one seam the scheduler calls (start, attach, commit,
finish). Behind it: the draft budget policy (`budget.py`: adaptive decoding length) over the
cost profile (`cost_profile.py`), acceptance tracking (`acceptance.py`, `fits.py`), the judging
of trees by later tokens (`judging.py`), the speed guard (`speed_guard.py`), speculation's host
time (`host_budget.py`) and the policy's own drafts (`policy_drafts.py`). Pure Python and numpy:
no torch, no gRPC.
"""

from batchserve.speculation.budget import DraftBudgetPolicy
from batchserve.speculation.cost_profile import CostProfile
from batchserve.speculation.planner import DraftPlanner

__all__ = ["CostProfile", "DraftBudgetPolicy", "DraftPlanner"]
