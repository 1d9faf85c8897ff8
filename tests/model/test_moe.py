"""Routed experts (`model.moe`): the routing's rules, files of each routed-expert architecture read
from their blocks (the mapping equal to transformers' load of the same file, every product on the
file's own blocks, the start-up check passed, each request's logits the same bits alone and
batched at every thread count), the file writer's Qwen3-30B-A3B plan, and a model whose attention
has a term ours does not compute (gpt-oss's sinks) refused, never served. The families' outputs
against transformers' `generate` are in test_families."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from batchserve.bench.gguf_mix import plan, planned_bytes, use_more_bits
from batchserve.bench.gguf_write import write_gguf
from batchserve.bench.shapes import ModelShape, build_model, get_shape
from batchserve.engine import EngineCore
from batchserve.model import blocks
from batchserve.model.gguf_native import load_gguf_native
from batchserve.model.loader import load_model
from batchserve.model.moe import KernelSparseMoE, Routing, SparseMoE
from tests.model.test_gguf_native import ExactBlockLinear, _config
from tests.model.test_llama import _all_logits

needs_blocks = pytest.mark.skipif(not blocks.block_products_invariant(), reason="our block kernels do not run here")

# Rows of 256 (the K-quants' super-block); 8 experts of 256, 2 or 3 used per token.
_TINY = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=512, vocab_size=49152, init_std=0.05, experts=8, experts_used=2,
             expert_intermediate=256)  # fmt: skip
SHAPES = {
    "qwen3moe": ModelShape("tiny-qwen3moe", **{**_TINY, "head_dim": 128}, arch="qwen3moe"),
    "qwen2moe": ModelShape("tiny-qwen2moe", **_TINY, arch="qwen2moe", qkv_bias=True, shared_expert_intermediate=512),
    "mixtral": ModelShape("tiny-mixtral", **{**_TINY, "experts": 4}, arch="llama"),
    "olmoe": ModelShape("tiny-olmoe", **{**_TINY, "experts_used": 3}, arch="olmoe"),
}
MODEL_TYPES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "mixtral": "mixtral", "olmoe": "olmoe"}
PROMPTS = [[5, 9, 33, 1, 200, 17], [7], list(range(40, 60))]


def _routing(**kw: object) -> Routing:
    values = dict(experts=4, top_k=2, renormalize=False, intermediate=8, shared_intermediate=None, sparse_step=1,
                  dense_layers=())  # fmt: skip
    return Routing(**{**values, **kw})  # type: ignore[arg-type]


def test_ties_go_to_the_lower_expert_and_renormalizing_divides_by_the_chosen_sum():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0], [4.0, -1.0, 2.0, 1.0]])
    weights, ids = _routing().route(logits)
    assert ids.tolist() == [[1, 2], [0, 1], [0, 2]]
    probs = torch.softmax(logits, dim=-1)
    assert torch.equal(weights, torch.gather(probs, 1, ids))
    renormed, same = _routing(renormalize=True).route(logits)
    assert torch.equal(same, ids) and torch.allclose(renormed.sum(-1), torch.ones(3))


def test_a_rows_output_is_the_same_bits_alone_and_among_any_others():
    """The router, the top-k and the ordered sum keep a row's bits whatever the other rows chose,
    given products that do (each row in its own call here)."""

    class Rowwise(torch.nn.Module):
        def __init__(self, seed: int, out: int = 16) -> None:
            super().__init__()
            self.w = torch.randn(16, out, generator=torch.Generator().manual_seed(seed))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.stack([row @ self.w for row in x])  # [T, out]: each row in a call of its own

    config = type("C", (), {"hidden_size": 16})()
    seeds = iter(range(100))
    moe = SparseMoE(config, _routing(experts=6, top_k=3, renormalize=True), lambda _: Rowwise(next(seeds)))
    moe.gate = Rowwise(100, 6)
    x = torch.randn(40, 16, generator=torch.Generator().manual_seed(1))
    together = moe(x)
    for i in (0, 7, 39):
        assert torch.equal(moe(x[i : i + 1]), together[i : i + 1])
    assert torch.equal(moe(x[5:30]), together[5:30])


def test_sparse_and_dense_layers_follow_the_config():
    r = _routing(sparse_step=2, dense_layers=(3,))
    assert [r.sparse(i) for i in range(6)] == [False, True, False, False, False, True]


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: write_gguf(root / f"{name}-Q4_K_M.gguf", shape, "Q4_K_M") for name, shape in SHAPES.items()}


@needs_blocks
@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe"])
def test_the_mapping_equals_transformers_load_of_the_same_file(moe_files, monkeypatch, name):
    """With exact products, the model read from the blocks (each expert's rows of the stacked
    tensors, the float32 router, Qwen2-MoE's shared expert and its gate) computes transformers'
    float32 model of the file."""
    path = moe_files[name]
    with monkeypatch.context() as m:
        m.setattr(blocks, "BlockLinear", ExactBlockLinear)
        native, tokenizer = load_gguf_native(path)
    hf, _ = load_model(path, "float32")
    assert hf.config.model_type == MODEL_TYPES[name]
    exact = {"model_impl": "native", "attention_backend": "torch"}
    got = _all_logits(EngineCore(_config(path, **exact), native, tokenizer), PROMPTS)
    want = _all_logits(EngineCore(_config(path, model_impl="transformers"), hf, tokenizer), PROMPTS)
    assert torch.allclose(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))


@needs_blocks
@pytest.mark.parametrize("name", list(SHAPES))
def test_a_routed_expert_file_runs_on_its_blocks_batch_invariant(moe_files, name):
    core = EngineCore(_config(moe_files[name]))
    model = core.runner.model
    assert model.config.model_type == MODEL_TYPES[name] and model.cpu_weights == "gguf"
    assert not model.gguf_report.dequantized and model.gguf_report.float_routers >= SHAPES[name].num_hidden_layers
    moe = model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and len(moe.experts) == SHAPES[name].experts
    assert moe.routing.top_k == SHAPES[name].experts_used
    assert all(isinstance(e.gate_up_proj, blocks.BlockLinear) for e in moe.experts)
    assert (moe.shared_expert is not None) == (name == "qwen2moe")
    assert core.facts.batch_invariant, core.facts.invariance_why  # the start-up check, experts included
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            batched = _all_logits(core, PROMPTS)
            start = 0
            for p in PROMPTS:
                assert torch.equal(batched[start : start + len(p)], _all_logits(core, [p])), (threads, len(p))
                start += len(p)
    finally:
        torch.set_num_threads(before)


@needs_blocks
@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe"])
def test_the_experts_in_one_kernel_call_are_the_python_loops_bits(moe_files, name):
    """`KernelSparseMoE` (csrc/moe.cpp) against `SparseMoE.forward`'s loop over the same experts."""
    model, _ = load_gguf_native(moe_files[name])
    moe = model.layers[1].mlp
    assert isinstance(moe, KernelSparseMoE)
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 5, 40, 300):
        x = torch.randn(rows, SHAPES[name].hidden_size, generator=gen)
        assert torch.equal(moe(x), SparseMoE.forward(moe, x)), rows


def test_the_qwen3_30b_a3b_plan_is_llama_quantizes_q4_k_m():
    shape = get_shape("qwen3-30b-a3b")
    tensors = {t.name: t for t in plan(shape, "Q4_K_M")}
    assert tensors["blk.0.ffn_gate_exps.weight"].shape == (128, 768, 2048)
    assert tensors["blk.0.ffn_down_exps.weight"].shape == (128, 2048, 768)
    assert tensors["blk.0.ffn_gate_inp.weight"].qtype == Q.F32  # the router is never quantized
    for i in range(shape.num_hidden_layers):
        bumped = Q.Q6_K if use_more_bits(i, 48) else Q.Q4_K
        assert tensors[f"blk.{i}.ffn_down_exps.weight"].qtype == bumped
        assert tensors[f"blk.{i}.attn_v.weight"].qtype == bumped
        assert tensors[f"blk.{i}.ffn_up_exps.weight"].qtype == Q.Q4_K
    # Qwen3-30B-A3B-Q4_K_M.gguf as published is 18.6 GB, llama.cpp's own mix the same as this one
    assert 17.0e9 < planned_bytes(shape, "Q4_K_M") < 19.0e9
    assert 30.0e9 < shape.num_params < 31.0e9
    with pytest.raises(ValueError, match="write it as a file"):
        build_model(shape, "cpu")


def test_attention_sinks_run_natively_and_are_never_dropped():
    """gpt-oss adds a learned logit per head to each softmax's denominator: our forward applies it
    (its outputs against transformers' in test_families), and where it would be dropped, on
    transformers' modules or a backend without it, the model is refused with the reason."""
    import transformers as tf

    from batchserve import LLM
    from tests.conftest import make_tiny_tokenizer
    from tests.model.test_llama import _model

    model = _model("gpt-oss")
    assert isinstance(model.config, tf.GptOssConfig)
    with pytest.raises(ValueError, match="sinks"):
        LLM(hf_model=model, tokenizer=make_tiny_tokenizer(), model_impl="transformers")
    with pytest.raises(ValueError, match="sinks"):
        LLM(hf_model=model, tokenizer=make_tiny_tokenizer(), model_impl="native", attention_backend="invariant")
    llm = LLM(hf_model=model, tokenizer=make_tiny_tokenizer(), model_impl="native", draft="none")
    sinks = llm.engine.runner.backend.layers[0].sinks
    assert sinks is not None and len(sinks) == model.config.num_attention_heads
