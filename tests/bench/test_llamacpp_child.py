"""The `llamacpp` peer's child process on fake llama.cpp loaders (`llama_fakes`): its runs come back
as the in-process peer's records; a child killed by a signal (llama.cpp's AMX kernels' SIGILL) is
rerun once on the fallback kernels, and a peer failing both ways raises with both reasons."""

from __future__ import annotations

import inspect
import sys
import time
import types
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from batchserve.bench.crashes import PeerFailed, exit_reason, peer_notes
from batchserve.bench.llamacpp_child import LlamaCppChild, LlamaSettings, make_llama
from batchserve.bench.methods import Row
from batchserve.bench.peers import PeerRun
from tests.bench import llama_fakes

SETTINGS = LlamaSettings("/models/m.gguf", 64, 1, 0)
PROMPTS = [[1, 2], [3, 4, 5]]


def _child(tmp_path: Path, loader: Any, **options: Any) -> tuple[LlamaCppChild, Path]:
    """A child whose loader notes each load (and its kernels) in the returned file."""
    loads = tmp_path / "loads.txt"
    return LlamaCppChild(SETTINGS, partial(loader, log=loads), **options), loads


def _loads(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def test_the_child_loads_once_and_returns_the_in_process_records(tmp_path: Path) -> None:
    child, loads = _child(tmp_path, llama_fakes.fine)
    try:
        first = child.run(PROMPTS, 4, frozenset({12}), "test")
        second = child.run(PROMPTS[:1], 2, frozenset(), "test")
    finally:
        child.close()
    assert isinstance(first, PeerRun)
    assert first.outputs == [[10, 11, 12], [10, 11, 12]]  # stopped at (and counting) the stop id
    assert first.seconds > 0 and len(first.ttfts) == 2 and len(first.tpots) == 2
    assert first.token_times is not None and all(len(ts) == 3 for ts in first.token_times)
    assert second.outputs == [[10, 11]]
    assert _loads(loads) == ["extra_bufts=True"]  # one load serves every run
    assert child.note is None and child.failed is None


@pytest.mark.parametrize(
    ("loader", "note"),
    [
        (llama_fakes.sigill_on_default_kernels, "llama.cpp's AMX/repacked kernels crashed (SIGILL)"),
        (llama_fakes.exits_quietly, "llama.cpp on its default kernels exited with status 3 without a result"),
    ],
)
def test_a_child_that_dies_is_rerun_on_the_fallback_kernels_and_says_so(tmp_path: Path, loader: Any, note: str) -> None:
    child, loads = _child(tmp_path, loader)
    try:
        run = child.run(PROMPTS, 4, frozenset(), "test")
        again = child.run(PROMPTS, 4, frozenset(), "test")  # a later round: on the fallback at once
    finally:
        child.close()
    assert run.outputs == again.outputs == [[10, 11, 12, 13]] * 2
    assert child.note == f"{note}; rerun with use_extra_bufts=False"
    assert _loads(loads) == ["extra_bufts=True", "extra_bufts=False"]
    assert not child.settings.extra_bufts


@pytest.mark.parametrize(
    ("loader", "why"),
    [
        (
            llama_fakes.crashes_both_ways,
            "llamacpp crashed (SIGILL) on its default kernels, and crashed (SIGSEGV) with use_extra_bufts=False",
        ),
        (
            llama_fakes.no_model,
            "llamacpp failed (ValueError: Failed to load model from file: /models/m.gguf) on its default kernels, "
            "and failed (ValueError: Failed to load model from file: /models/m.gguf) with use_extra_bufts=False",
        ),
    ],
)
def test_a_peer_that_fails_both_ways_raises_with_both_reasons(tmp_path: Path, loader: Any, why: str) -> None:
    child, loads = _child(tmp_path, loader)
    with pytest.raises(PeerFailed) as failed:
        child.run(PROMPTS, 4, frozenset(), "test")
    assert str(failed.value) == why == child.failed
    with pytest.raises(PeerFailed, match="on its default kernels"):  # later rounds: at once, no load
        child.run(PROMPTS, 4, frozenset(), "test")
    assert _loads(loads) == ["extra_bufts=True", "extra_bufts=False"]
    assert child.note is None


def test_a_child_that_gives_no_answer_is_stopped_at_the_timeout_and_not_rerun(tmp_path: Path) -> None:
    child, loads = _child(tmp_path, llama_fakes.hangs, timeout_s=8.0)
    t0 = time.monotonic()
    with pytest.raises(PeerFailed, match="llamacpp gave no result within 8 s on its default kernels"):
        child.run(PROMPTS, 4, frozenset(), "test")
    assert time.monotonic() - t0 < 60  # the wait is bounded, and the stuck child killed
    assert _loads(loads) in ([], ["extra_bufts=True"])  # its one start (other kernels cure no hang)


class _Native:
    """llama-cpp-python's ctypes layer: the model defaults `Llama` reads at each load."""

    def __init__(self, has_field: bool) -> None:
        self.has_field = has_field

    def llama_model_default_params(self) -> Any:
        return types.SimpleNamespace(use_extra_bufts=True) if self.has_field else types.SimpleNamespace()


def _fake_llama_cpp(monkeypatch: pytest.MonkeyPatch, native: _Native, takes_flag: bool = False) -> list[Any]:
    """A `llama_cpp` package whose `Llama` records its kwargs and the model defaults it was built on."""
    made: list[Any] = []
    native_module = types.ModuleType("llama_cpp.llama_cpp")
    native_module.llama_model_default_params = native.llama_model_default_params  # type: ignore[attr-defined]

    def llama(**kwargs: Any) -> Any:
        made.append((kwargs, native_module.llama_model_default_params()))  # type: ignore[attr-defined]
        return made[-1]

    if takes_flag:  # a later llama-cpp-python that names the flag itself
        llama.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter("use_extra_bufts", inspect.Parameter.KEYWORD_ONLY)]
        )
    package = types.ModuleType("llama_cpp")
    package.Llama = llama  # type: ignore[attr-defined]
    package.llama_cpp = native_module  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp", package)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_cpp", native_module)
    return made


def test_the_fallback_turns_off_llama_cpps_extra_buffer_types(monkeypatch: pytest.MonkeyPatch) -> None:
    made = _fake_llama_cpp(monkeypatch, _Native(has_field=True))
    make_llama(SETTINGS)
    kwargs, params = made[-1]
    assert "use_extra_bufts" not in kwargs and params.use_extra_bufts  # the defaults: repacked/AMX kernels
    assert kwargs["model_path"] == "/models/m.gguf" and kwargs["n_ctx"] == 64 and kwargs["n_threads_batch"] == 1
    # llama-cpp-python 0.3 would swallow the keyword unused: the model defaults it loads from change
    make_llama(LlamaSettings("/models/m.gguf", 64, 1, 0, extra_bufts=False))
    kwargs, params = made[-1]
    assert params.use_extra_bufts is False


def test_the_fallback_is_passed_by_name_where_llama_takes_it_and_refused_where_it_cannot_be(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fallback = LlamaSettings("/models/m.gguf", 64, 1, 0, extra_bufts=False)
    made = _fake_llama_cpp(monkeypatch, _Native(has_field=True), takes_flag=True)
    make_llama(fallback)
    assert made[-1][0]["use_extra_bufts"] is False
    _fake_llama_cpp(monkeypatch, _Native(has_field=False))  # a llama.cpp without the field
    with pytest.raises(RuntimeError, match="cannot turn off llama"):
        make_llama(fallback)


def test_exits_and_notes_read_as_the_report_says_them() -> None:
    assert exit_reason(-4) == "crashed (SIGILL)" and exit_reason(-11) == "crashed (SIGSEGV)"
    assert exit_reason(3) == "exited with status 3" and exit_reason(None) == "did not exit"

    def row(method: str, dataset: str, note: str | None) -> Row:
        return Row(method, dataset, 1, 2, 8, 1.0, 8.0, 1.0, 0.1, 0.1, 0.01, 0.01, None, note=note)

    crashed = row("llamacpp", "humaneval", "it crashed")
    rows = [crashed, crashed, row("hf", "humaneval", None)]
    assert peer_notes(rows, ["`llama-server` failed.", "`llama-server` failed."]) == [
        "`llamacpp` on humaneval: it crashed.",
        "`llama-server` failed.",
    ]
