"""The `hf-static` peer: one static cache for the whole run (its tensors never move, so a captured
CUDA graph would stay valid), outputs equal to plain greedy, and per-token times."""

from __future__ import annotations

from typing import Any

import pytest

from batchserve.bench.methods import make_row
from batchserve.bench.peers import PeerRun, run_hf
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
