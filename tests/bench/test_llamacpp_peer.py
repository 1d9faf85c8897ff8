"""The `llamacpp` bench peer on a fake `llama_cpp` module and fake children (`llama_fakes`): its
settings, its loop, its report row, and the sweep going on where llama.cpp crashes."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from batchserve.bench.llamacpp_child import load_llamacpp, make_llama
from batchserve.bench.peers import LLAMACPP_MISSING, PeerRun, llamacpp_gguf, run_llamacpp
from tests.bench import llama_fakes


class FakeLlama:
    """Records what the peer asks of llama.cpp; generates 10, 11, 12, ... or a scripted list."""

    made: ClassVar[list[FakeLlama]] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        self.events: list[str] = []
        self.calls: list[tuple[list[int], dict[str, Any]]] = []
        self.yielded = 0  # tokens the generator produced: each past the last is a wasted eval
        self.scripts: dict[int, list[int]] = {}  # first prompt id -> the tokens to generate
        FakeLlama.made.append(self)

    def reset(self) -> None:
        self.events.append("reset")

    def generate(self, tokens: list[int], **kwargs: Any) -> Iterator[int]:
        self.events.append("generate")
        self.calls.append((list(tokens), kwargs))
        for tok in self.scripts.get(tokens[0], range(10, 10_000)):
            self.yielded += 1
            yield tok


@pytest.fixture
def fake_llama_cpp(monkeypatch: pytest.MonkeyPatch) -> type[FakeLlama]:
    module = types.ModuleType("llama_cpp")
    module.Llama = FakeLlama  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setattr(FakeLlama, "made", [])
    return FakeLlama


def test_peer_feeds_token_ids_greedy_resets_per_prompt_and_counts_tokens() -> None:
    llm = FakeLlama()
    llm.scripts[7] = [30, 2, 31]  # ends at an end-of-sequence id
    prompts = [[5, 6], [7, 8, 9]]
    outputs, seconds, ttfts, tpots = run_llamacpp(llm, prompts, 4, frozenset({2}), "test")
    # The end-of-sequence token counts (as HF's and the engine's outputs have it), then it stops.
    assert outputs == [[10, 11, 12, 13], [30, 2]]
    assert llm.yielded == 6  # never one token past what it keeps
    assert [ids for ids, _ in llm.calls] == prompts
    assert llm.events == ["reset", "generate", "reset", "generate"]  # no KV kept across prompts
    for _, kwargs in llm.calls:
        assert kwargs["temp"] == 0.0 and kwargs["top_k"] == 1 and kwargs["repeat_penalty"] == 1.0
    assert seconds > 0 and len(ttfts) == 2 and len(tpots) == 2


def test_llama_cpp_gets_the_gguf_the_threads_and_room_for_prompt_and_output(
    fake_llama_cpp: type[FakeLlama], tmp_path: Path
) -> None:
    gguf = tmp_path / "m.gguf"
    peer = load_llamacpp(gguf, [[1] * 30, [1] * 50], 16)
    assert peer.load is make_llama and peer.settings.extra_bufts  # llama.cpp's own kernels first
    make_llama(peer.settings)  # what the child runs to load (here in this process, on the fake module)
    (llm,) = fake_llama_cpp.made
    threads = torch.get_num_threads()
    assert llm.kwargs["model_path"] == str(gguf) and llm.kwargs["n_ctx"] == 50 + 16
    assert llm.kwargs["n_threads"] == llm.kwargs["n_threads_batch"] == threads
    assert llm.kwargs["n_batch"] == 512 and llm.kwargs["verbose"] is False and llm.kwargs["logits_all"] is False
    assert "use_extra_bufts" not in llm.kwargs


def test_peer_runs_only_on_a_gguf_with_llama_cpp_importable(
    fake_llama_cpp: type[FakeLlama], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    gguf = tmp_path / "m.gguf"
    gguf.touch()
    assert llamacpp_gguf(str(gguf)) == (gguf, "")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    path, why = llamacpp_gguf(str(tmp_path / "hf"))
    assert path is None and "not a GGUF model" in why
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # what `import llama_cpp` sees when not installed
    assert llamacpp_gguf(str(gguf)) == (None, LLAMACPP_MISSING)


def _tiny_sweep(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    model: Any,
    tokenizer: Any,
    methods: tuple[str, ...] = ("hf", "llamacpp"),
    **options: Any,
) -> list[dict[str, Any]]:
    """The bench sweep with `methods` at batch 1 on two prompts, without a real model: the tiny
    model, a fixed HF reference, and whatever `llama_cpp` (and llama.cpp loader) the test installed."""
    from batchserve.bench import sweep
    from batchserve.model import loader

    reference = [[10, 11, 12, 13], [5, 6, 7, 8]]
    monkeypatch.setattr(loader, "load_model", lambda path, dtype: (model, tokenizer))
    monkeypatch.setattr(sweep, "load_dataset", lambda name, n, tok: sweep.Workload([[1, 2], [3, 4, 5]], []))
    monkeypatch.setattr(sweep, "run_hf", lambda m, prompts, *a, **k: (reference[: len(prompts)], 1.0, [0.1], [0.1]))
    gguf = tmp_path / "m.gguf"
    gguf.touch()
    sweep.run(["humaneval"], list(methods), [1], 2, 4, tmp_path / "out", str(gguf), **options)
    return json.loads((tmp_path / "out" / "results.json").read_text())


def _children_load(monkeypatch: pytest.MonkeyPatch, loader: Any) -> None:
    """The sweep's llamacpp child loads with `loader` (one of `llama_fakes`) instead of llama-cpp-python."""
    from batchserve.bench import sweep

    monkeypatch.setattr(sweep, "load_llamacpp", partial(load_llamacpp, load=loader))


def test_sweep_puts_the_llamacpp_row_beside_hf_in_the_report(
    fake_llama_cpp: type[FakeLlama],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tiny_model: Any,
    tiny_tokenizer: Any,
) -> None:
    _children_load(monkeypatch, llama_fakes.fine)
    rows = {r["method"]: r for r in _tiny_sweep(monkeypatch, tmp_path, tiny_model, tiny_tokenizer)}
    row = rows["llamacpp"]
    assert row["batch_size"] == 1 and row["num_prompts"] == 2 and row["output_tokens"] == 8
    assert row["lossless"] is None and row["reference_matches"] == 1  # the fake's 10, 11, ... is prompt 1's
    assert row["note"] is None
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| llamacpp | 1 |" in report and "| hf | 1 |" in report
    assert "sequential" in report and "equals HF greedy on 1 of 2 prompts" in report
    assert "AMX" not in report


def test_sweep_reruns_a_llamacpp_killed_by_sigill_on_the_fallback_kernels_and_says_so(
    fake_llama_cpp: type[FakeLlama],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tiny_model: Any,
    tiny_tokenizer: Any,
) -> None:
    _children_load(monkeypatch, llama_fakes.sigill_on_default_kernels)
    rows = {r["method"]: r for r in _tiny_sweep(monkeypatch, tmp_path, tiny_model, tiny_tokenizer)}
    row = rows["llamacpp"]
    note = "llama.cpp's AMX/repacked kernels crashed (SIGILL); rerun with use_extra_bufts=False"
    assert row["output_tokens"] == 8 and row["reference_matches"] == 1 and row["note"] == note
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"`llamacpp` on humaneval: {note}." in report and "| llamacpp | 1 |" in report


def test_sweep_goes_on_where_llamacpp_fails_both_ways_and_says_why(
    fake_llama_cpp: type[FakeLlama],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tiny_model: Any,
    tiny_tokenizer: Any,
) -> None:
    _children_load(monkeypatch, llama_fakes.crashes_both_ways)
    methods = ("hf", "llamacpp", "none")
    rows = _tiny_sweep(monkeypatch, tmp_path, tiny_model, tiny_tokenizer, methods, repeats=2)
    assert sorted(r["method"] for r in rows) == ["hf", "none"]  # the rows after it ran
    report = (tmp_path / "out" / "report.md").read_text()
    why = "llamacpp crashed (SIGILL) on its default kernels, and crashed (SIGSEGV) with use_extra_bufts=False"
    assert report.count(f"`llamacpp` on humaneval failed: {why}.") == 1  # once, though each round ran into it
    assert "| none | 1 |" in report and "| llamacpp |" not in report


def test_sweep_without_llama_cpp_skips_the_peer_and_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tiny_model: Any,
    tiny_tokenizer: Any,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    rows = _tiny_sweep(monkeypatch, tmp_path, tiny_model, tiny_tokenizer)
    assert [r["method"] for r in rows] == ["hf"]
    assert LLAMACPP_MISSING in capsys.readouterr().out
    report = (tmp_path / "out" / "report.md").read_text()
    assert "llamacpp: not installed (pip install 'batchserve[llamacpp]')" in report


def test_repeated_sweep_runs_llamacpp_in_the_rounds_at_batch_1_and_keeps_the_median(
    fake_llama_cpp: type[FakeLlama],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    tiny_model: Any,
    tiny_tokenizer: Any,
) -> None:
    """With repeats, llama.cpp's speed is sampled beside ours, round by round (the machine's speed
    drifts), from one load; its row is the kept run of the repeats, like a batchserve row's."""
    from batchserve.bench import sweep
    from batchserve.bench.methods import make_row

    order: list[str] = []
    speeds = iter([4.0, 1.0, 2.0])  # seconds of the three batchserve runs

    def fake_row(s: Any, dataset: str, b: int, method: str, prompts: list[list[int]], *args: Any, **kw: Any) -> Any:
        order.append(method)
        return make_row(method, dataset, b, [[1, 2]] * len(prompts), next(speeds), [0.1], [0.1], 1.0, True)

    peers: list[_InProcessPeer] = []
    monkeypatch.setattr(sweep, "_batchserve_row", fake_row)
    monkeypatch.setattr(sweep, "load_llamacpp", lambda *args: peers.append(_InProcessPeer(order)) or peers[-1])
    methods = ("hf", "llamacpp", "none")
    rows = _tiny_sweep(monkeypatch, tmp_path, tiny_model, tiny_tokenizer, methods, repeats=3, keep="median")
    assert order == ["llamacpp", "none"] * 3  # in rounds, never all of one engine first
    assert len(peers) == 1 and peers[0].closed  # loaded once for the dataset, stopped at the end
    assert sorted(r["method"] for r in rows) == ["hf", "llamacpp", "none"]  # one row each
    (ours,) = [r for r in rows if r["method"] == "none"]
    assert ours["seconds"] == 2.0  # the median of 4, 1 and 2 seconds
    assert len(ours["run_tokens_per_s"]) == 3
    report = (tmp_path / "out" / "report.md").read_text()
    assert "the llamacpp row where batch 1 is swept, is the median of 3 runs" in report
    assert "Every run's tokens/s, in round order: llamacpp b=1: " in report and "; none b=1: 1.0, 4.0, 2.0." in report


@dataclass
class _InProcessPeer:
    """The llamacpp child's interface, run here on a FakeLlama: the sweep's rounds under test, not the child."""

    order: list[str]
    llm: FakeLlama = field(default_factory=FakeLlama)
    note: str | None = None
    closed: bool = False

    def run(self, prompts: list[list[int]], max_new: int, stop: Collection[int], desc: str) -> PeerRun:
        self.order.append("llamacpp")
        return run_llamacpp(self.llm, prompts, max_new, stop, desc)

    def close(self) -> None:
        self.closed = True


@pytest.mark.parametrize("mode", ["request", "always"])
def test_sweep_reports_llama_server_restarted_with_no_repack_or_failed_and_goes_on(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model: Any, tiny_tokenizer: Any, mode: str
) -> None:
    from batchserve.bench import sweep
    from batchserve.bench.served import ServedPeers

    binary, _ = llama_fakes.fake_llama_server(tmp_path, mode)
    monkeypatch.setenv("LLAMA_SERVER", str(binary))
    # our server's weights choice reads the GGUF: this one is empty, and only llama-server is served
    monkeypatch.setattr(
        sweep, "served_peers", lambda m, path, e, b, logs, peer: ServedPeers(path, "gguf", 16, logs, peer)
    )
    rows = {
        r["method"]: r for r in _tiny_sweep(monkeypatch, tmp_path, tiny_model, tiny_tokenizer, ("hf", "llama-server"))
    }
    report = (tmp_path / "out" / "report.md").read_text()
    if mode == "request":
        note = "llama.cpp's AMX/repacked kernels crashed (SIGILL) while serving; restarted with --no-repack"
        assert rows["llama-server"]["output_tokens"] == 4 and rows["llama-server"]["note"] == note
        assert f"`llama-server` on humaneval: {note}." in report
    else:
        assert list(rows) == ["hf"]
        assert (
            "`llama-server` on humaneval failed: llama-server crashed (SIGILL) while serving on its default" in report
        )
