"""The drafter's native code: built once and reused, a clear error where it cannot be built,
bad input refused without a crash, and deferred learning (the engine's) lagging one step and
losing nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from batchserve import LLM, SamplingParams
from batchserve.config import DraftConfig
from batchserve.draft import TrieDrafter, native
from tests.conftest import make_tiny_model, make_tiny_tokenizer


def test_a_build_that_cannot_run_says_why_and_a_build_is_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHSERVE_BUILD_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with pytest.raises(native.DrafterUnavailable, match=r"failed to build the native drafter.*--draft none"):
        native.build()
    assert not list((tmp_path / "draft").iterdir())  # no half-built file left behind
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(native.native_build, "compiler", lambda: None)
    with pytest.raises(native.DrafterUnavailable, match=r"no C\+\+ compiler"):
        native.build()
    monkeypatch.undo()
    monkeypatch.setenv("BATCHSERVE_BUILD_DIR", str(tmp_path))
    built = native.build()
    assert built.parent == tmp_path / "draft" and built.stat().st_size > 0
    stamp = built.stat().st_mtime_ns
    assert native.build() == built and built.stat().st_mtime_ns == stamp  # built once, then reused


def test_an_engine_without_the_native_drafter_fails_at_start_up_saying_why(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchserve.draft import trie

    def unavailable() -> None:
        raise native.DrafterUnavailable("no C++ compiler (g++) to build the native drafter: install g++")

    monkeypatch.setattr(trie, "library", unavailable)
    with pytest.raises(native.DrafterUnavailable, match=r"install g\+\+"):
        LLM(hf_model=make_tiny_model(), tokenizer=make_tiny_tokenizer(), draft="lookahead")
    llm = LLM(hf_model=make_tiny_model(), tokenizer=make_tiny_tokenizer(), draft="none")  # needs none
    assert llm.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))[0].token_ids


def test_the_draft_package_imports_neither_torch_nor_grpc() -> None:
    code = "import sys, batchserve.draft; from batchserve.draft import native; native.library(); " \
        "print(sorted(m for m in ('torch', 'grpc') if m in sys.modules))"  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_bad_input_is_refused_without_harm() -> None:
    d = TrieDrafter(DraftConfig(method="lookahead"))
    with pytest.raises(ValueError, match="token ids"):
        d.on_request_start("a", [1, -2, 3])
    with pytest.raises(TypeError):
        d.on_request_start("a", [1, "x"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="token ids"):
        d.warm_up([[2**40]])
    assert d.stats()["requests"] == 0 and d.num_nodes == 0
    d.on_request_start("a", [1, 2, 3, 1, 2])
    with pytest.raises(ValueError):
        d.on_tokens_accepted("a", [-1])
    assert d.num_indexed_tokens == 5  # nothing of the refused call kept
    d.on_tokens_accepted("nobody", [1, 2])  # an unknown request: ignored
    assert d.propose("nobody", [1, 2], 8) is None and d.propose("a", [1, 2, 3, 1, 2], 0) is None
    assert d.propose("a", [1, 2, 3, 1, 2], 8) is not None


def test_deferred_learning_lags_one_step_and_loses_nothing() -> None:
    d = TrieDrafter(DraftConfig(method="lookahead", branch_length=3))
    d.on_request_start("z", [9], scope="s")  # a scope exists once a request of it ended
    d.on_tokens_accepted("z", [4])
    d.on_request_finish("z")
    d.defer_learning()
    d.on_request_start("a", [9], scope="s")
    d.on_tokens_accepted("a", [1, 2, 3])
    d.on_tokens_accepted("a", [1, 2])
    assert d.trie_counts("s") == {(4,): 1} and d.stats()["pending"] == 1  # nothing inserted yet
    assert d.propose("a", [9, 1, 2, 3, 1, 2], 4).tokens[0] == 3  # its own text never waits
    d.learn()
    assert d.stats()["pending"] == 0
    counts = d.trie_counts("s")
    assert counts is not None and counts[(1, 2, 3)] == 1 and counts[(1, 2)] == 2 and counts[(3, 1, 2)] == 1
    d.on_tokens_accepted("a", [3, 7])
    d.on_request_finish("a")  # a request that ends inserts what it held back
    counts = d.trie_counts("s")
    assert counts is not None and counts[(2, 3, 7)] == 1 and counts[(1, 2, 3)] == 2


def test_the_engine_learns_beside_the_forward_and_its_output_is_unchanged() -> None:
    """Deferred as on a GPU (on a CPU the engine inserts at once: measured cheaper there)."""
    prompts = [[5, 6, 7, 8] * 3, [9, 10, 11] * 4, [5, 6, 7] * 4]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    outs = []
    for method in ("lookahead", "none"):
        llm = LLM(hf_model=make_tiny_model(), tokenizer=make_tiny_tokenizer(), draft=method)
        drafter = llm.engine.speculation.drafter
        if method == "lookahead":
            assert isinstance(drafter, TrieDrafter)
            drafter.defer_learning()
            pending: list[int] = []
            llm.engine.step_listeners.append(lambda out, phases, d=drafter, p=pending: p.append(d.stats()["pending"]))
        outs.append([r.token_ids for r in llm.generate(prompts, params)])
        if method == "lookahead":
            assert max(pending) > 0  # tokens waited for the next step's `learn`
            stats = drafter.stats()
            assert stats["pending"] == 0 and stats["requests"] == 0 and stats["indexed_tokens"] == 0
            # Every output's runs reached the shared trie, though each step's waited a step.
            counts = drafter.trie_counts("")
            assert counts is not None
            for out in outs[0]:
                assert tuple(out[:3]) in counts and tuple(out[-3:]) in counts
    assert outs[0] == outs[1]
    cpu = LLM(hf_model=make_tiny_model(), tokenizer=make_tiny_tokenizer(), draft="lookahead")
    held: list[int] = []
    cpu.engine.step_listeners.append(lambda out, phases: held.append(cpu.engine.speculation.drafter.stats()["pending"]))
    cpu.generate(prompts, params)
    assert held and max(held) == 0  # on a CPU the engine inserts at once
