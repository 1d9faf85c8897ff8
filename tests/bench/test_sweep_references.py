"""What each bench row is judged against, and which HF runs a sweep pays for: HF greedy only where
a row is judged by it (float32 on a CPU, llama.cpp) or is it (`hf`); on a GPU every method is
judged against the same engine's `none`, so a GPU check spends no time on an HF reference."""

from __future__ import annotations

from typing import Any

import pytest

from batchserve.bench import sweep
from batchserve.bench.methods import expected_outputs

PROMPTS = [[1, 2], [3, 4, 5], [6], [7, 8]]


class _Tokenizer:
    eos_token_id = 0


class _Bar:
    def update(self, n: int) -> None:
        pass


def _peer_rows(monkeypatch: pytest.MonkeyPatch, methods: list[str], on_device: bool) -> tuple[list[Any], list[str]]:
    """(the reference returned, the HF runs made: their progress labels) for 2 of 4 prompts."""
    runs: list[str] = []

    def run_hf(model: Any, prompts: list[list[int]], max_new: int, eos: int, lookup: Any, desc: str, **kw: Any) -> Any:
        runs.append(desc)
        return [[9] * max_new for _ in prompts], 1.0, [0.1], [0.1]

    monkeypatch.setattr(sweep, "run_hf", run_hf)
    s = sweep._Sweep(methods, 3, 16, 1, "fastest", None, None, _Tokenizer(), {}, _Bar())
    s.on_device = on_device
    return sweep._peer_rows(s, "d", PROMPTS, 2), runs


def test_on_a_gpu_our_methods_need_no_hf_run(monkeypatch: pytest.MonkeyPatch) -> None:
    reference, runs = _peer_rows(monkeypatch, ["none", "lookahead-adaptive"], on_device=True)
    assert runs == [] and reference == [[], [], [], []]
    reference, runs = _peer_rows(monkeypatch, ["hf-static", "none", "lookahead-adaptive"], on_device=True)
    assert runs == ["d hf-static"] and reference == [[], [], [], []]  # the peer's row, nothing judged by it


def test_on_a_cpu_float32_methods_are_judged_by_hf_greedy_on_every_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    reference, runs = _peer_rows(monkeypatch, ["none", "lookahead-adaptive"], on_device=False)
    assert runs == ["d hf", "d reference"] and len(reference) == 4 and all(reference)
    # Methods on the file's blocks are judged by their own `none`: the `hf` row runs, only over its prompts.
    reference, runs = _peer_rows(monkeypatch, ["hf", "none-gguf"], on_device=False)
    assert runs == ["d hf"] and reference == [[9] * 3] * 2


def test_on_a_gpu_each_method_is_judged_against_the_engines_own_none() -> None:
    own: dict[Any, list[list[int]]] = {}
    key = ("d", 16, None)
    hf = [[1, 2, 3]]
    assert expected_outputs("none", "float32", hf, own, key, [[1, 2, 4]], on_device=True) is None
    assert expected_outputs("lookahead-adaptive", "float32", hf, own, key, [[1, 2, 4]], on_device=True) == [[1, 2, 4]]
    assert expected_outputs("lookahead-adaptive", "float32", hf, own, key, [[1, 2, 4]]) == hf  # on a CPU
