"""The native drafter's binding (csrc/module.cpp, on nanobind): its constants are the ones Python
names, every entry point refuses misuse with a Python exception (an object never initialised or
initialised twice, settings, ids, layouts and ranges out of bounds), another thread's call waits
for a flush that runs without the GIL instead of racing it, and the build is keyed by nanobind's
version and says what to do without it."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from batchserve.config import DRAFT_LAYOUTS, DraftConfig
from batchserve.draft import native, trie
from batchserve.trees import MATCH_CAP

SETTINGS = {
    "branch_length": 4, "own_branch_length": 8, "max_match": 4, "min_match": 1, "prompt_weight": 100.0,
    "trie_capacity": 1000, "scope_bytes": 1 << 20, "trie_max_scopes": 4, "recent_output_tokens": 100,
    "copy_chain": True, "layout": 0,
}  # fmt: skip


def test_the_constants_python_names_are_the_modules() -> None:
    lib = native.library()
    assert lib.MATCH_CAP == MATCH_CAP
    assert lib.LAYOUTS == trie.LAYOUTS == {name: code for code, name in enumerate(DRAFT_LAYOUTS)}
    d = trie.TrieDrafter(DraftConfig(method="lookahead"))
    for output in ([5, 6], [7]):
        d.on_request_start("a", [1])
        d.on_tokens_accepted("a", output)
        d.on_request_finish("a")
    assert d.recent_text("") == [5, 6, lib.SEPARATOR, 7, lib.SEPARATOR]  # "-1 between two" (trie.py)


def test_an_object_never_initialised_or_initialised_twice_is_refused() -> None:
    cls = native.library().Drafter
    raw = cls.__new__(cls)
    calls: list[tuple[str, tuple[Any, ...]]] = [
        ("memory", ()), ("set_deferred", (True,)), ("flush", ()), ("stats", ()), ("start", ("a", [1], None, -1)),
        ("propose", ("a", [1], 1, 4)), ("trie", ("",)), ("recent_text", ("",)), ("fail_next", (1,)),
    ]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # nanobind says which instance it refused
        for name, args in calls:
            with pytest.raises(TypeError):
                getattr(raw, name)(*args)
        d = cls(**SETTINGS)
        with pytest.raises(TypeError):
            d.__init__(**SETTINGS)
    d.start("a", [1, 2, 1], "", -1)
    assert d.propose("a", [1, 2, 1], 3, 4) is not None  # the first initialisation stands


@pytest.mark.parametrize(
    ("name", "value"),
    [("branch_length", 1), ("own_branch_length", 1), ("own_branch_length", 2**31), ("min_match", 0),
     ("max_match", 0), ("prompt_weight", 0.0), ("prompt_weight", float("nan")), ("trie_capacity", 0),
     ("scope_bytes", 4095), ("trie_max_scopes", 0), ("recent_output_tokens", -1), ("layout", -1), ("layout", 3)],
)  # fmt: skip
def test_settings_out_of_range_are_refused(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match="invalid drafter settings"):
        native.library().Drafter(**{**SETTINGS, name: value})


class _Falsy:
    def __bool__(self) -> bool:
        raise ZeroDivisionError("no truth here")


def test_every_entry_point_checks_its_arguments() -> None:
    d = native.library().Drafter(**SETTINGS)
    d.start("a", [1, 2, 1, 2], "s", -1)
    refused: list[tuple[type[BaseException], str | None, Any]] = [
        (ValueError, "layout", lambda: d.start("b", [1], None, 3)),
        (TypeError, None, lambda: d.start(b"b", [1], None, -1)),  # ids are str, never bytes
        (TypeError, None, lambda: d.start("b", [1], 5, -1)),  # a scope is a str or None
        (TypeError, "sequence of ints", lambda: d.accept("a", 7)),
        (ValueError, "token ids", lambda: d.accept("a", [1, 2**31])),
        (OverflowError, None, lambda: d.accept("a", [2**70])),
        (TypeError, None, lambda: d.accept("a", [1.5])),
        (ZeroDivisionError, "no truth", lambda: d.set_deferred(_Falsy())),
        (ValueError, "first <= last", lambda: d.warm("s", [1, 2], 2, 1)),
        (ValueError, "kind must be", lambda: d.fail_next(4)),
        (TypeError, None, lambda: d.propose("a", [1], 1.5, 4)),
        (TypeError, None, lambda: d.memory(1)),
        (TypeError, None, lambda: d.stats(scope="s")),
    ]
    for error, words, call in refused:
        with pytest.raises(error, match=words):
            call()
    assert d.stats()["indexed_tokens"] == 4 and d.propose("a", [1, 2, 1, 2], 4, 0) is None


CHILD = r"""
import json, sys, threading
from batchserve.config import DraftConfig
from batchserve.draft.trie import TrieDrafter

config = DraftConfig(method="lookahead", branch_length=8, trie_capacity=10**9, trie_scope_bytes=1 << 40)
text = lambda i, j: [(i * 7919 + j * 104729 + k * k) % 5000 for k in range(400)]
rounds = [[(f"r{i}", text(i, j)) for i in range(8)] for j in range(24)]

def drive(d, flusher):
    for i in range(8):
        d.on_request_start(f"r{i}", [1, 2, 3], scope="s")
    d.defer_learning()
    done = threading.Event()
    thread = threading.Thread(target=flusher, args=(d, done)) if flusher else None
    if thread:
        thread.start()
    trees = 0
    for j, batch in enumerate(rounds):  # accepting, proposing and reading while another thread flushes
        for rid, tokens in batch:
            d.on_tokens_accepted(rid, tokens)
            trees += d.propose(rid, tokens, 16) is not None
        d.stats(), d.memory_bytes(), j % 8 or d.trie_counts("s")
    done.set()
    if thread:
        thread.join()
    d.learn()
    for i in range(8):
        d.on_request_finish(f"r{i}")
    return trees, {" ".join(map(str, k)): v for k, v in (d.trie_counts("s") or {}).items()}

def flusher(d, done):
    while not done.is_set():
        d.learn()

(trees, raced), (_, alone) = drive(TrieDrafter(config), flusher), drive(TrieDrafter(config), None)
print(json.dumps([trees, len(alone), raced == alone]))
"""


def test_another_threads_call_waits_for_a_flush_without_the_gil() -> None:
    """In a child process: without the drafter's lock, an accept during a flush would write the
    queue that flush reads, and a proposal would read a trie being written."""
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    trees, nodes, same = json.loads(done.stdout.strip().splitlines()[-1])
    assert trees > 0 and nodes > 1000 and same  # the same counts as with no thread beside it


def test_the_build_is_keyed_by_nanobinds_version_and_says_what_to_do_without_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import nanobind

    built: list[tuple[tuple[Path, ...], tuple[str, ...], bytes]] = []

    def fake(what: str, folder: str, stem: str, sources, headers, flags, extra: bytes = b"") -> Path:
        built.append((tuple(sources), tuple(flags), extra))
        return Path("built.so")

    monkeypatch.setattr(native.native_build, "build", fake)
    native.build()
    monkeypatch.setattr(nanobind, "__version__", "99.0.0")
    native.build()
    (sources, flags, key), (_, _, newer) = built
    assert Path(nanobind.source_dir()) / "nb_combined.cpp" in sources and set(native.SOURCES) < set(sources)
    assert f"-I{nanobind.include_dir()}" in flags and key != newer and b"99.0.0" in newer
    monkeypatch.setitem(sys.modules, "nanobind", None)  # not installed
    with pytest.raises(native.DrafterUnavailable, match=r"nanobind is not installed.*--draft none"):
        native.build()
