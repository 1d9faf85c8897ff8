"""Per-op thread counts: no row's elementwise work is split between threads."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from batchserve.model.layers import SiluAndMul
from batchserve.threads import GRAIN_SIZE, VECTOR_STEP, row_threads, torch_threads


def test_the_threads_chosen_split_an_op_at_whole_rows_without_a_tail():
    rng = random.Random(0)
    for _ in range(2000):
        rows, threads = rng.randint(1, 300), rng.randint(1, 16)
        width = rng.choice([64, 576, 896, 1536, 4864, 8960, 100])
        t = row_threads(rows, width, threads)
        assert 1 <= t <= threads
        n = rows * width
        chunks = 1 if n <= GRAIN_SIZE else min(t, -(-n // GRAIN_SIZE))
        if chunks > 1:  # torch's split at t threads: equal chunks of whole rows, a multiple of a vector step
            assert rows % chunks == 0 and (n // chunks) % VECTOR_STEP == 0, (rows, width, threads, t)
    assert row_threads(20, 4864, 8) == 2  # 3 chunks would cut rows; 2 do not
    assert row_threads(7, 100, 8) == 8  # one chunk at any thread count


def test_torch_threads_switches_and_restores():
    before = torch.get_num_threads()
    with torch_threads(3):
        assert torch.get_num_threads() == 3
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError), torch_threads(2):
        raise ValueError
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("width", [1536, 4864, 8960])
@pytest.mark.parametrize("threads", [3, 8])
def test_silu_and_mul_gives_a_row_the_same_bits_in_any_step_at_any_thread_count(width, threads):
    """torch's own `silu(gate) * up` does not at 8960 (a row cut between threads); ours does."""
    gen = torch.Generator().manual_seed(1)
    gate_up = torch.randn(256, 2 * width, generator=gen)
    layer = SiluAndMul()
    with torch_threads(1):
        alone = layer(gate_up[10:11])
    with torch_threads(threads):
        for rows in (11, 20, 21, 64, 100, 256):
            out = layer(gate_up[:rows])
            assert torch.equal(out[10:11], alone), rows
            g, u = gate_up[:rows].chunk(2, dim=-1)
            torch.testing.assert_close(out, F.silu(g) * u, rtol=1e-6, atol=1e-6)  # silu(gate) * up, to the last bits
