"""A C++ failure in the native drafter is a Python exception, never a crash: with the GIL held
or released (`learn()` runs the insertion with it released), for a bad_alloc, a standard
exception or any other, and the drafter goes on afterwards with nothing lost.

The failures come from the module's test hook (`fail_next`: the next trie insertion throws). The
checks run in a child interpreter: before the binding was exception-safe, an exception thrown
with the GIL released skipped reacquiring it and the process died, which would take pytest down."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import json, threading
from batchserve.config import DraftConfig
from batchserve.draft.trie import TrieDrafter

BAD_ALLOC, RUNTIME, OTHER = 1, 2, 3
d = TrieDrafter(DraftConfig(method="lookahead", branch_length=3))
native, seen = d._native, {}

def attempt(name, kind, call):
    native.fail_next(kind)
    try:
        call()
        seen[name] = None
    except Exception as e:
        seen[name] = [type(e).__name__, str(e)]

d.defer_learning()
d.on_request_start("a", [9], scope="s")
d.on_tokens_accepted("a", [1, 2, 3])
# With the GIL released (the engine's learn() beside the forward), each kind of failure:
for name, kind in (("learn bad_alloc", BAD_ALLOC), ("learn runtime", RUNTIME), ("learn other", OTHER)):
    attempt(name, kind, d.learn)
# The GIL is this thread's again: another thread runs and joins.
ran = []
worker = threading.Thread(target=lambda: ran.append(sum(range(1000))))
worker.start()
worker.join()
seen["thread ran"] = ran == [499500]
attempt("set_deferred(False)", BAD_ALLOC, lambda: native.set_deferred(False))
seen["still queued"] = d.stats()["pending"]
d.learn()  # nothing was lost: it inserts what the failures left queued
seen["counts"] = {" ".join(map(str, k)): v for k, v in (d.trie_counts("s") or {}).items()}
native.set_deferred(False)
attempt("accept", RUNTIME, lambda: d.on_tokens_accepted("a", [4]))
d.on_tokens_accepted("a", [5])
seen["after"] = (d.trie_counts("s") or {}).get((3, 4, 5))
d.on_request_start("b", [7], scope="s")
native.set_deferred(True)
d.on_tokens_accepted("b", [8, 9])
attempt("finish", BAD_ALLOC, lambda: d.on_request_finish("b"))  # it ends all the same
stats = d.stats()
seen["ended"] = [stats["requests"], stats["pending"], stats["indexed_tokens"]]
d.on_request_finish("a")
seen["end"] = d.stats()["requests"]
print(json.dumps(seen))
"""


def test_a_native_failure_raises_with_the_gil_held_or_released_and_loses_nothing() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["learn bad_alloc"][0] == "MemoryError"
    assert seen["learn runtime"] == ["RuntimeError", "injected failure"]
    assert seen["learn other"][0] == "RuntimeError" and "non-standard" in seen["learn other"][1]
    assert seen["thread ran"] is True
    assert seen["set_deferred(False)"][0] == "MemoryError" and seen["still queued"] == 1  # still deferred
    assert seen["counts"] == {"1": 1, "1 2": 1, "1 2 3": 1, "2": 1, "2 3": 1, "3": 1}
    assert seen["accept"] == ["RuntimeError", "injected failure"]
    assert seen["after"] == 1  # the runs were found afresh after the failed insertion
    assert seen["finish"][0] == "MemoryError" and seen["ended"] == [1, 0, 6]  # only "a" is left, whole
    assert seen["end"] == 0


def test_resume_after_accepted_output_is_refused() -> None:
    from batchserve.config import DraftConfig
    from batchserve.draft.trie import TrieDrafter

    d = TrieDrafter(DraftConfig(method="lookahead"))
    d.on_request_start("a", [1, 2])
    d.on_tokens_accepted("a", [3])
    try:
        d.on_tokens_resumed("a", [4])
    except ValueError as e:
        assert "before any accepted token" in str(e)
    else:
        raise AssertionError("resume after output was taken")
    assert d.num_indexed_tokens == 3
