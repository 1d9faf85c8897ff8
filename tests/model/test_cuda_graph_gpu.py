"""The native forward captured in a CUDA graph replays the eager forward's logits (skipped without CUDA)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from batchserve.model import native_from_hf
from tests.conftest import make_tiny_fa2_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


class StaticAttention:
    """A backend over static buffers (causal attention of the step's rows among themselves): the
    capture is about the model's own ops; FlashInfer plans outside the graph."""

    def forward(
        self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: object, scale: float
    ) -> torch.Tensor:
        # The backends' layout: [heads, T, D] in, [T, Hq, D] out.
        out = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)  # [T, Hq, D]


@pytest.mark.parametrize("rows", [1, 8, 32])
def test_a_step_replayed_from_a_cuda_graph_equals_the_eager_one(rows):
    model = native_from_hf(make_tiny_fa2_model().to("cuda"))  # bfloat16, head dim 64 (as the GPU tests' model)
    meta = SimpleNamespace(backend=StaticAttention())
    vocab = model.config.vocab_size
    ids = torch.zeros(1, rows, dtype=torch.long, device="cuda")
    pos = torch.arange(rows, device="cuda")[None]
    keep = torch.arange(rows, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        for _ in range(2):  # warm-up outside the graph: lazy inits, allocator pools
            model(ids, pos, keep, meta)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), torch.inference_mode():
        captured = model(ids, pos, keep, meta).logits
    gen = torch.Generator(device="cuda").manual_seed(0)
    for start in (0, 100, 900):  # new tokens at new positions: only the buffers change
        new_ids = torch.randint(0, vocab, (1, rows), device="cuda", generator=gen)
        new_pos = torch.arange(start, start + rows, device="cuda")[None]
        ids.copy_(new_ids)
        pos.copy_(new_pos)
        graph.replay()
        with torch.inference_mode():
            eager = model(new_ids, new_pos, keep, meta).logits
        assert torch.equal(captured, eager)
