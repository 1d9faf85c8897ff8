"""The `hf-static` peer: one static cache for the whole run (its tensors never move, so a captured
CUDA graph would stay valid), outputs equal to plain greedy, per-token times, and the proof that its
forward ran compiled (bench/compiled.py): an eager run, or one at eager speed, fails its row."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from batchserve.bench import peers, sweep
from batchserve.bench.compiled import (
    HF_STATIC_MAX_MS_CUDA,
    CompileStats,
    PeerNotCompiled,
    StaticPeer,
    check_compiled,
    count_compiled_calls,
    decode_limit_ms,
    watch_compiles,
)
from batchserve.bench.methods import make_row
from batchserve.bench.peers import PeerRun, peer_row, run_hf
from tests.conftest import hf_greedy, make_tiny_model

MAX_NEW = 6
PROMPTS = [[5, 17, 3], [9, 1, 44, 2, 8, 100, 7], [3] * 12]  # three lengths: each warmed, then timed


def test_hf_static_reuses_one_cache_and_equals_plain_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import StaticCache

    model = make_tiny_model()
    expected = [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    real = model.generate
    calls: list[tuple[Any, list[tuple[int, int]], int]] = []  # (cache, K/V data pointers, tokens it holds)

    def spy(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        cache = kwargs.get("cache")
        assert isinstance(cache, StaticCache), "each call gets the run's own static cache"
        ptrs = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
        calls.append((cache, ptrs, int(cache.get_seq_length())))
        return out

    monkeypatch.setattr(model, "generate", spy)
    run = run_hf(model, PROMPTS, MAX_NEW, 0, None, "test", static=True, compile_forward=False)

    # (a) warm-up on each of the 3 lengths, then the 3 timed prompts: one cache, never reallocated
    assert len(calls) == 2 * len(PROMPTS)
    cache, ptrs, _ = calls[0]
    assert all(c is cache for c, _, _ in calls) and all(p == ptrs for _, p, _ in calls)
    assert len(ptrs) == model.config.num_hidden_layers
    assert cache.layers[0].keys.shape[2] == max(map(len, PROMPTS)) + MAX_NEW
    # reset before each prompt: it holds this prompt and its output (the last token is never fed)
    assert [n for _, _, n in calls[-3:]] == [len(p) + MAX_NEW - 1 for p in PROMPTS]

    # (b) the same tokens as plain greedy with a fresh cache per prompt
    assert run.outputs == expected

    # (c) one arrival time per token, in order; TTFT the first, TPOT from the first to the last
    assert run.token_times is not None
    assert [len(ts) for ts in run.token_times] == [len(o) for o in run.outputs] == [MAX_NEW] * 3
    assert all(ts == sorted(ts) for ts in run.token_times)
    assert run.ttfts == [ts[0] for ts in run.token_times] and all(t >= 0 for t in run.ttfts)
    assert len(run.tpots) == 3 and all(t > 0 for t in run.tpots)
    assert run.tpots == pytest.approx([(ts[-1] - ts[0]) / (MAX_NEW - 1) for ts in run.token_times])
    assert run.seconds >= sum(ts[-1] for ts in run.token_times)
    assert run.decode == [(MAX_NEW - 1, ts[-1] - ts[0]) for ts in run.token_times]


def test_a_peer_run_unpacks_as_the_old_tuple_and_its_row_has_the_decode_rate() -> None:
    run = PeerRun([[1, 2, 3], [4]], 2.0, [0.5, 0.4], [0.25], [[0.5, 0.75, 1.0], [0.4]])
    outputs, seconds, ttfts, tpots = run
    assert (outputs, seconds, ttfts, tpots) == ([[1, 2, 3], [4]], 2.0, [0.5, 0.4], [0.25])
    assert run.decode == [(2, 0.5)]  # a one-token request has no decode span
    row = make_row("hf-static", "d", 1, outputs, seconds, ttfts, tpots, 1.0, None, run.decode)
    assert row.tokens_per_s == 2.0 and row.decode_tokens_per_s == 4.0  # 4 tokens / 2 s; 2 / 0.5 s
    assert make_row("hf", "d", 1, outputs, seconds, ttfts, tpots, 1.0, None).decode_tokens_per_s is None


def _eager_though_asked_to_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_hf` asks for a compiled forward; `generate` is told `disable_compile` all the same."""
    real = peers.static_cache_kwargs
    monkeypatch.setattr(peers, "static_cache_kwargs", lambda m, p, n, compile_forward=True: real(m, p, n, False))


@pytest.mark.parametrize("compiled_before", [False, True])
def test_an_eager_run_that_was_asked_to_compile_fails(monkeypatch: pytest.MonkeyPatch, compiled_before: bool) -> None:
    model = make_tiny_model()
    if compiled_before:  # as after an earlier compiled run: a compiled forward that this run never calls
        model._compiled_call = model.__call__
    _eager_though_asked_to_compile(monkeypatch)
    with pytest.raises(PeerNotCompiled, match=r"ran eager: 0 of its 15 timed decode steps"):
        run_hf(model, PROMPTS, MAX_NEW, 0, None, "test", static=True)


def test_check_compiled_asks_for_every_step_compiled_a_graph_and_the_speed() -> None:
    decode = [(5, 0.01), (5, 0.01)]  # 10 tokens in 20 ms: 2 ms a token
    stats = CompileStats(graphs=1, compiled_steps=10)
    check_compiled(stats, decode, HF_STATIC_MAX_MS_CUDA, compiled_before=False)
    assert stats.decode_steps == 10
    with pytest.raises(PeerNotCompiled, match="9 of its 10"):
        check_compiled(CompileStats(graphs=1, compiled_steps=9), decode, None, compiled_before=False)
    with pytest.raises(PeerNotCompiled, match="compiled no graph"):
        check_compiled(CompileStats(compiled_steps=10), decode, None, compiled_before=False)
    check_compiled(CompileStats(compiled_steps=10), decode, None, compiled_before=True)  # a repeat: graphs cached
    slow = [(5, 0.1), (5, 0.1)]  # 20 ms a token: eager speed on CUDA
    with pytest.raises(PeerNotCompiled, match=r"20\.0 ms a token, over its limit of 10 ms"):
        check_compiled(CompileStats(graphs=1, compiled_steps=10), slow, HF_STATIC_MAX_MS_CUDA, compiled_before=False)
    check_compiled(CompileStats(graphs=1, compiled_steps=10), slow, None, compiled_before=False)  # a CPU: no limit
    check_compiled(CompileStats(), [(0, 0.0)], HF_STATIC_MAX_MS_CUDA, compiled_before=False)  # one token: no decode


def test_the_decode_limit_is_10_ms_on_cuda_none_on_a_cpu_and_configurable() -> None:
    cuda, cpu = SimpleNamespace(device=torch.device("cuda", 0)), SimpleNamespace(device=torch.device("cpu"))
    assert decode_limit_ms(cuda) == HF_STATIC_MAX_MS_CUDA == 10.0
    assert decode_limit_ms(cpu) is None and decode_limit_ms(None) is None
    assert decode_limit_ms(cuda, 25.0) == 25.0 and decode_limit_ms(cpu, 25.0) == 25.0
    assert decode_limit_ms(cuda, float("inf")) is None
    for bad in ({"repeats": 0}, {"max_ms": 0.0}, {"max_ms": float("nan")}):
        with pytest.raises(ValueError, match="at least once"):
            StaticPeer(**bad)


def test_watch_compiles_counts_graphs_recompiles_breaks_and_cuda_graph_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dynamo's start callbacks and counters, fed by hand: what a CUDA compile would feed them."""
    from torch._dynamo.callback import CallbackArgs, CallbackTrigger, callback_handler
    from torch._dynamo.utils import counters

    for key in ("stats", "graph_break", "inductor"):
        monkeypatch.setitem(counters, key, Counter())
    stats = CompileStats()
    with watch_compiles(stats, timed=True):
        assert torch._dynamo.config.fail_on_recompile_limit_hit  # past the limit: an error, not eager
        for compile_id in ("0/0", "0/1", "1/0"):
            callback_handler.run_start_callbacks(CallbackArgs(CallbackTrigger.DYNAMO, compile_id))
        for _ in range(2):
            callback_handler.run_start_callbacks(CallbackArgs(CallbackTrigger.CUDAGRAPH_RECORDING, "0/1"))
        counters["stats"]["unique_graphs"] += 3
        counters["graph_break"]["a reason"] += 1
        counters["inductor"]["cudagraph_skips"] += 1
    assert (stats.graphs, stats.timed_graphs, stats.recompiles) == (3, 3, 1)
    assert (stats.graph_breaks, stats.cudagraph_records, stats.cudagraph_skips) == (1, 2, 1)
    assert not torch._dynamo.config.fail_on_recompile_limit_hit
    callback_handler.run_start_callbacks(CallbackArgs(CallbackTrigger.DYNAMO, "0/2"))  # after: not counted
    assert stats.recompiles == 1 and stats.note().startswith("compiled 3 graphs (1 recompiles, 3 while timed)")


def test_count_compiled_calls_wraps_the_compiled_forward_and_puts_it_back() -> None:
    def forward(x: int) -> int:
        return x + 1

    model, stats = SimpleNamespace(_compiled_call=forward), CompileStats()
    with count_compiled_calls(model, stats):
        assert [model._compiled_call(1), model._compiled_call(2)] == [2, 3]
    assert stats.compiled_steps == 2 and model._compiled_call is forward
    bare = SimpleNamespace()  # transformers never compiled it
    with count_compiled_calls(bare, stats):
        assert not hasattr(bare, "_compiled_call")
    assert stats.compiled_steps == 2


def _static_sweep(monkeypatch: pytest.MonkeyPatch, fail_at: int | None, repeats: int) -> Any:
    """A sweep over hf-static alone whose peer runs are doubles at 10, 30, 20 tok/s (or fail at run `fail_at`)."""
    calls: list[dict[str, Any]] = []

    def fake(model: Any, prompts: list[list[int]], max_new: int, eos: int, lookup: Any, desc: str, **kw: Any) -> Any:
        calls.append(kw)
        if len(calls) == fail_at:
            raise PeerNotCompiled("hf-static ran eager: 0 of its 2 timed decode steps called it")
        seconds = [1.0, 1 / 3, 0.5][len(calls) - 1]  # 10 tokens each
        return PeerRun([[7] * 5, [8] * 5], seconds, [0.1, 0.1], [0.1], None, CompileStats(graphs=1, compiled_steps=8))

    monkeypatch.setattr(sweep, "run_hf", fake)
    tokenizer, bar = SimpleNamespace(eos_token_id=0), SimpleNamespace(update=lambda n: None)
    s = sweep._Sweep(["hf-static"], 5, 16, 1, "median", None, None, tokenizer, {}, bar)
    s.hf_static = StaticPeer(repeats=repeats)
    sweep._peer_rows(s, "d", [[1, 2], [3, 4]], 2)
    return s, calls


def test_hf_static_keeps_the_median_of_its_repeats_with_what_compile_did(monkeypatch: pytest.MonkeyPatch) -> None:
    s, calls = _static_sweep(monkeypatch, None, repeats=3)
    assert calls == [{"static": True, "max_decode_ms": None}] * 3  # a CPU: no decode limit
    [row] = s.rows
    assert row.run_tokens_per_s == [10.0, 30.0, 20.0] and row.tokens_per_s == 20.0 and not s.failures
    assert row.compile_stats is not None and row.compile_stats["compiled_steps"] == 8
    assert row.note is not None and row.note.startswith("compiled 1 graphs")


def test_hf_static_that_did_not_compile_fails_its_row(monkeypatch: pytest.MonkeyPatch) -> None:
    s, calls = _static_sweep(monkeypatch, 2, repeats=2)
    assert len(calls) == 2 and s.rows == []  # the first run's row is not kept either
    assert s.failures == ["`hf-static` on d failed: hf-static ran eager: 0 of its 2 timed decode steps called it."]


@pytest.mark.slow  # inductor compiles the tiny model's forward: about 30 s on a CPU, its cache cold
def test_a_compiled_run_proves_it_and_an_eager_one_on_the_same_model_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_tiny_model()
    expected = [hf_greedy(model, p, MAX_NEW) for p in PROMPTS]
    run = run_hf(model, PROMPTS, MAX_NEW, 0, None, "test", static=True)
    assert run.outputs == expected and run.compile is not None
    steps = len(PROMPTS) * (MAX_NEW - 1)
    assert run.compile.graphs >= 1 and run.compile.timed_graphs == 0  # compiled in the warm-up, not while timed
    assert run.compile.compiled_steps == run.compile.decode_steps == steps
    assert (run.compile.graph_breaks, run.compile.cudagraph_records) == (0, 0)  # fullgraph; a CPU
    assert peer_row("hf-static", "d", 1, run, 1.0, True).compile_stats == asdict(run.compile)
    again = run_hf(model, PROMPTS, MAX_NEW, 0, None, "test", static=True)  # a repeat: the graphs are cached
    assert again.compile is not None and again.compile.graphs == 0 and again.compile.compiled_steps == steps
    with pytest.raises(PeerNotCompiled, match="ms a token, over its limit"):
        run_hf(model, PROMPTS, MAX_NEW, 0, None, "test", static=True, max_decode_ms=1e-6)
    _eager_though_asked_to_compile(monkeypatch)  # its compiled forward is there, and goes uncalled
    with pytest.raises(PeerNotCompiled, match=f"0 of its {steps} timed decode steps"):
        run_hf(model, PROMPTS, MAX_NEW, 0, None, "test", static=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_hf_static_replays_cuda_graphs_within_its_limit() -> None:
    model = make_tiny_model().to("cuda")
    run = run_hf(model, PROMPTS, MAX_NEW, 0, None, "test", static=True, max_decode_ms=HF_STATIC_MAX_MS_CUDA)
    assert run.compile is not None and run.compile.cudagraph_records >= 1 and run.compile.cudagraph_skips == 0
    assert run.compile.compiled_steps >= run.compile.decode_steps == len(PROMPTS) * (MAX_NEW - 1)


@pytest.mark.parametrize(
    "argv, message",
    [(["--peer-repeats", "0"], "--peer-repeats"), (["--hf-static-max-ms", "0"], "--hf-static-max-ms must be > 0")],
)
def test_the_bench_refuses_a_peer_that_would_not_run(argv: list[str], message: str, capsys) -> None:
    from batchserve.cli import main

    assert main(["bench", "--methods", "hf-static", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_bench_hands_the_peers_repeats_and_limit_to_the_sweep(monkeypatch, tmp_path) -> None:
    import batchserve.bench as bench
    from batchserve.cli import main

    seen: dict[str, Any] = {}

    def run(*args: Any) -> list:
        seen["peer"] = args[-1]
        return []

    monkeypatch.setattr(bench, "run", run)
    argv = ["--methods", "hf-static", "--peer-repeats", "2", "--hf-static-max-ms", "7.5", "--out", str(tmp_path)]
    assert main(["bench", *argv]) == 0
    assert seen["peer"] == StaticPeer(2, 7.5)


def test_a_repeated_peer_writes_its_row_after_each_run_so_a_cut_sweep_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """After each of hf-static's runs the row as it stands is written (provisional, with how many
    ran); the final row replaces it. A sweep cut in its third run (SIGINT) leaves the second's."""
    written: list[list[Any]] = []
    real = sweep._peer_rows

    def recording(s: Any, *args: Any) -> Any:
        s.write = lambda rows: written.append([(r.runs_done, r.tokens_per_s) for r in rows])
        return real(s, *args)

    monkeypatch.setattr(sweep, "_peer_rows", recording)
    s, _ = _static_sweep(monkeypatch, None, repeats=3)
    assert written == [[(1, 10.0)], [(2, 10.0)], [(3, 20.0)], [(None, 20.0)]] and s.rows[0].runs_done is None
    written.clear()
    monkeypatch.setattr(sweep, "_peer_rows", recording)
    calls = 0

    def cut(*args: Any, **kw: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt  # the device's time limit: SIGINT
        return PeerRun([[7] * 5, [8] * 5], 1.0, [0.1, 0.1], [0.1], None, CompileStats(graphs=1, compiled_steps=8))

    tokenizer, bar = SimpleNamespace(eos_token_id=0), SimpleNamespace(update=lambda n: None)
    s = sweep._Sweep(["hf-static"], 5, 16, 1, "median", None, None, tokenizer, {}, bar)
    s.hf_static = StaticPeer(repeats=3)
    monkeypatch.setattr(sweep, "run_hf", cut)
    with pytest.raises(KeyboardInterrupt):
        sweep._peer_rows(s, "d", [[1, 2], [3, 4]], 2)
    assert written[-1] == [(2, 10.0)]  # what the two runs measured stays on disk
