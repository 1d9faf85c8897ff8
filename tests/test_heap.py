"""The long-lived heap frozen out of full collections, and handed back where it must be."""

from __future__ import annotations

import gc
import weakref

from batchserve import heap


class _Node:
    pass


def _cycle() -> weakref.ref:
    node = _Node()
    node.me = node  # only the cyclic collector can free it
    return weakref.ref(node)


def test_settle_collects_first_then_freezes_what_lives():
    gone = _cycle()  # garbage already
    live = _Node()
    live.me = live
    kept = weakref.ref(live)
    try:
        heap.settle()
        assert gone() is None  # collected, not frozen
        del live
        gc.collect()
        assert kept() is not None  # frozen while alive: full collections pass it by
    finally:
        gc.unfreeze()
    gc.collect()
    assert kept() is None


def test_a_settled_run_hands_its_frozen_objects_back():
    node = _Node()
    node.me = node
    ref = weakref.ref(node)
    with heap.settled():
        assert gc.get_freeze_count() > 0
        del node
        gc.collect()
        assert ref() is not None  # frozen: a full collection passes it by
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None
