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
    # sinks, biases on q/k/v/o, the router and the experts, MXFP4 experts, a 16-key window, YaRN
    "gpt-oss": ModelShape("tiny-gpt-oss", **_TINY, arch="gpt-oss", qkv_bias=True, sliding_window=16, yarn=(32.0, 4096)),
}
MODEL_TYPES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "mixtral": "mixtral", "olmoe": "olmoe",
               "gpt-oss": "gpt_oss"}  # fmt: skip
QUANTS = {"gpt-oss": "MXFP4_MOE"}  # the others: Q4_K_M
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


def test_a_routing_that_cannot_choose_is_refused():
    for bad in ({"top_k": 0}, {"top_k": 5}, {"intermediate": 0}):
        with pytest.raises(ValueError, match="routing"):
            _routing(**bad)


def test_sparse_and_dense_layers_follow_the_config():
    r = _routing(sparse_step=2, dense_layers=(3,))
    assert [r.sparse(i) for i in range(6)] == [False, True, False, False, False, True]


@pytest.fixture(scope="module")
def moe_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {
        name: write_gguf(root / f"{name}.gguf", shape, QUANTS.get(name, "Q4_K_M")) for name, shape in SHAPES.items()
    }


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
    if name == "gpt-oss":
        assert "MXFP4" in model.gguf_report.native and model.layers[0].self_attn.sinks is not None
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
@pytest.mark.parametrize("name", ["qwen3moe", "qwen2moe", "gpt-oss"])
def test_the_experts_in_one_kernel_call_are_the_python_loops_bits(moe_files, name):
    """`KernelSparseMoE` (csrc/moe.cpp) against `SparseMoE.forward`'s loop over the same experts
    (gpt-oss's: biases on both products and the clamped SwiGLU)."""
    model, _ = load_gguf_native(moe_files[name])
    moe = model.layers[1].mlp
    assert isinstance(moe, KernelSparseMoE)
    assert (moe.clamp is not None) == (moe.experts[0].down_proj.bias is not None) == (name == "gpt-oss")
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


def test_the_gpt_oss_20b_plan_is_llama_quantizes_mxfp4_moe():
    shape = get_shape("gpt-oss-20b")
    tensors = {t.name: t for t in plan(shape, "MXFP4_MOE")}
    for p in ("gate", "up", "down"):
        assert tensors[f"blk.0.ffn_{p}_exps.weight"].qtype == Q.MXFP4
        assert tensors[f"blk.0.ffn_{p}_exps.bias"].qtype == Q.F32
    assert tensors["blk.0.attn_q.weight"].qtype == Q.Q8_0 and tensors["output.weight"].qtype == Q.Q8_0
    assert tensors["blk.0.attn_sinks.weight"].shape == (64,) and "blk.0.attn_output.bias" in tensors
    assert "blk.0.post_attention_norm.weight" in tensors and "blk.0.ffn_norm.weight" not in tensors
    # ggml-org's gpt-oss-20b-mxfp4.gguf is 12.1 GB; gpt-oss-20b has 20.9B parameters
    assert 11.5e9 < planned_bytes(shape, "MXFP4_MOE") < 12.5e9 and 20.5e9 < shape.num_params < 21.5e9


def test_attention_sinks_run_natively_and_are_never_dropped():
    """gpt-oss adds a learned logit per head to each softmax's denominator: our forward applies it
    on both CPU invariant backends (the C++ kernel's and the torch-op one's greedy output is
    transformers'), and where it would be dropped, on transformers' modules, the model is refused
    with the reason (FlashInfer's: `tests/attention/test_flashinfer_contract.py`)."""
    import transformers as tf

    from batchserve import LLM, SamplingParams
    from tests.conftest import hf_greedy, make_tiny_tokenizer
    from tests.model.test_llama import _model

    model = _model("gpt-oss")
    assert isinstance(model.config, tf.GptOssConfig)
    with pytest.raises(ValueError, match="sinks"):
        LLM(hf_model=model, tokenizer=make_tiny_tokenizer(), model_impl="transformers")
    prompts = [[5, 9, 2, 7] * 3, [1, 2, 3], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
    expected = [hf_greedy(model, p, 8, ignore_eos=True) for p in prompts]
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for backend in ("kernel", "invariant"):  # the C++ kernel and the torch-op invariant backend
        llm = LLM(hf_model=model, tokenizer=make_tiny_tokenizer(), model_impl="native", draft="none",
                  attention_backend=backend)  # fmt: skip
        sinks = llm.engine.runner.backend.layers[0].sinks
        assert sinks is not None and len(sinks) == model.config.num_attention_heads
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected, backend


def _write_gpt_oss(model: torch.nn.Module, path: Path) -> Path:
    """`model` (a tiny transformers gpt-oss) as llama.cpp's converter writes one: experts MXFP4 with
    gate and up split from their interleaved stack, everything else Q8_0 or F32, the sinks, the
    biases, the window and YaRN in the metadata. The model's weights become the values the file's
    blocks hold, so that it is the file's exact float32 model."""
    import gguf
    from gguf import GGMLQuantizationType, GGUFWriter, dequantize, quantize

    from batchserve.bench.gguf_write import _copy_tokenizer, default_gguf

    c, rope = model.config, model.config.rope_parameters
    writer = GGUFWriter(str(path), "gpt-oss")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_sliding_window(c.sliding_window)
    writer.add_expert_count(c.num_local_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_expert_feed_forward_length(c.intermediate_size)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    _copy_tokenizer(writer, default_gguf(), c.vocab_size)

    def add(name: str, values: torch.Tensor, qtype: GGMLQuantizationType | None = None) -> None:
        """Write `values` (a view of a parameter) and set them to what the file holds."""
        array = values.detach().float().contiguous().numpy()
        if qtype is None:
            writer.add_tensor(name, array)
            return
        blocks_ = quantize(array, qtype)
        writer.add_tensor(name, blocks_, raw_shape=blocks_.shape, raw_dtype=qtype)
        with torch.no_grad():
            values.copy_(torch.from_numpy(dequantize(blocks_, qtype).reshape(array.shape)))

    q8, mx = GGMLQuantizationType.Q8_0, GGMLQuantizationType.MXFP4
    p = dict(model.named_parameters())
    add("token_embd.weight", p["model.embed_tokens.weight"], q8)
    add("output.weight", p["lm_head.weight"], q8)
    add("output_norm.weight", p["model.norm.weight"])
    for i in range(c.num_hidden_layers):
        pre, blk = f"model.layers.{i}.", f"blk.{i}."
        add(f"{blk}attn_norm.weight", p[pre + "input_layernorm.weight"])
        add(f"{blk}post_attention_norm.weight", p[pre + "post_attention_layernorm.weight"])
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                             ("attn_output", "o_proj")):  # fmt: skip
            add(f"{blk}{ours}.weight", p[f"{pre}self_attn.{theirs}.weight"], q8)
            add(f"{blk}{ours}.bias", p[f"{pre}self_attn.{theirs}.bias"])
        add(f"{blk}attn_sinks.weight", p[pre + "self_attn.sinks"])
        add(f"{blk}ffn_gate_inp.weight", p[pre + "mlp.router.weight"])
        add(f"{blk}ffn_gate_inp.bias", p[pre + "mlp.router.bias"])
        gate_up = p[pre + "mlp.experts.gate_up_proj"]  # [E, H, 2I], gate and up interleaved
        bias = p[pre + "mlp.experts.gate_up_proj_bias"]  # [E, 2I]
        add(f"{blk}ffn_gate_exps.weight", gate_up[:, :, ::2].transpose(1, 2), mx)
        add(f"{blk}ffn_up_exps.weight", gate_up[:, :, 1::2].transpose(1, 2), mx)
        add(f"{blk}ffn_down_exps.weight", p[pre + "mlp.experts.down_proj"].transpose(1, 2), mx)  # [E, H, I]
        add(f"{blk}ffn_gate_exps.bias", bias[:, ::2])
        add(f"{blk}ffn_up_exps.bias", bias[:, 1::2])
        add(f"{blk}ffn_down_exps.bias", p[pre + "mlp.experts.down_proj_bias"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@needs_blocks
def test_a_gpt_oss_file_reads_its_mxfp4_experts_sinks_and_biases(tmp_path, monkeypatch):
    """A gpt-oss GGUF as llama.cpp's converter writes one: with exact products our model of it
    computes transformers' gpt-oss of the file's values (transformers' own GGUF reader fails on
    the file's YaRN keys); on our kernels its MXFP4 experts run on their blocks, batch-invariant
    (the start-up check passed). YaRN as llama.cpp computes it (its bounds truncated)."""
    import transformers as tf

    from batchserve.model.gguf_file import read_meta
    from batchserve.model.gguf_read import read_gguf

    vocab = len(read_gguf(__import__("batchserve.bench.gguf_write", fromlist=["x"]).default_gguf()).metadata[
        "tokenizer.ggml.tokens"].value)  # fmt: skip
    config = tf.GptOssConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=131072, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                         "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    hf = tf.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("bias", "sinks")):
                p.normal_(0, 0.5)
    path = _write_gpt_oss(hf, tmp_path / "gpt-oss-MXFP4.gguf")
    read, _ = read_meta(path)
    assert read.model_type == "gpt_oss" and read.num_local_experts == 4 and read.intermediate_size == 64
    assert read.sliding_window == 8 and read.rope_parameters["rope_type"] == "yarn"
    with monkeypatch.context() as m:
        m.setattr(blocks, "BlockLinear", ExactBlockLinear)
        native, tokenizer = load_gguf_native(path)
    prompts = [[5, 9, 33, 1, 200, 17], [7], list(range(40, 60))]  # past the 8-key window
    exact = {"model_impl": "native", "attention_backend": "torch"}
    got = _all_logits(EngineCore(_config(path, **exact), native, tokenizer), prompts)
    with torch.no_grad():  # transformers' own forward: its eager attention applies the sinks
        want = torch.cat([hf(torch.tensor([p])).logits[0] for p in prompts])
    assert torch.allclose(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))
    core = EngineCore(_config(path))
    model = core.runner.model
    assert model.cpu_weights == "gguf" and {"MXFP4", "Q8_0"} <= set(model.gguf_report.native)
    assert not model.gguf_report.dequantized
    assert core.facts.batch_invariant, core.facts.invariance_why
