"""The native Llama-family forward against transformers, in float32, with tiny random models of
each supported architecture: the same logits up to float32 rounding on every packed row, and the
engine's greedy output equal to HF `generate` with drafts on."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

import batchserve.model
from batchserve import LLM, SamplingParams
from batchserve.attention import LayerAttention
from batchserve.engine import EngineCore
from batchserve.model import NativeLlamaForCausalLM, choose_impl, native_from_hf, supports
from batchserve.model.llama import layer_attention, rope_limit
from batchserve.records import ScheduledRequest
from batchserve.runner.batch import pack
from tests.conftest import TINY_VOCAB, hf_greedy, make_tiny_tokenizer
from tests.engine.drafters import OracleDrafter
from tests.rounding import assert_rounds_like, float64_logits, rounding_units

SMALL = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.3,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
    "rope_theta": 500000.0,
}


def _model(kind: str) -> Any:
    import transformers as tf

    if kind == "llama":
        config = tf.LlamaConfig(**SMALL, head_dim=16, tie_word_embeddings=False)
    elif kind == "llama3-rope-bias-tied":
        config = tf.LlamaConfig(
            **SMALL, rope_scaling=LLAMA3_ROPE, attention_bias=True, mlp_bias=True, tie_word_embeddings=True
        )
    elif kind == "mistral":
        config = tf.MistralConfig(**SMALL, head_dim=16, sliding_window=None, tie_word_embeddings=False)
    elif kind == "qwen2":
        config = tf.Qwen2Config(**SMALL, tie_word_embeddings=True, use_sliding_window=False)
    elif kind == "mistral-window":  # every layer windowed, prompts and outputs well past it
        config = tf.MistralConfig(**SMALL, head_dim=16, sliding_window=8, tie_word_embeddings=False)
    elif kind == "qwen2-window":  # the first layer full, the second windowed
        config = tf.Qwen2Config(
            **SMALL, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8, max_window_layers=1
        )
    elif kind == "qwen3":
        config = tf.Qwen3Config(**SMALL, head_dim=16, tie_word_embeddings=False, use_sliding_window=False)
    elif kind == "gemma2":  # windowed and global layers, both soft-caps small enough to bite
        config = tf.Gemma2Config(
            **{**SMALL, "num_hidden_layers": 3}, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
            attn_logit_softcapping=2.0, final_logit_softcapping=3.0, tie_word_embeddings=True,
        )  # fmt: skip
    elif kind == "gemma3":  # q/k norms, and the windowed layers' own rotary (theta 1e4 against 1e6)
        config = tf.Gemma3TextConfig(
            **{**SMALL, "num_hidden_layers": 3}, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"], tie_word_embeddings=True,
        )  # fmt: skip
    elif kind == "phi3":  # fused q|k|v and gate|up in the checkpoint, half the head rotated, LongRoPE, a window
        longrope = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 4.0], "long_factor": [8.0] * 4}
        config = tf.Phi3Config(
            **SMALL, partial_rotary_factor=0.5, original_max_position_embeddings=64, rope_scaling=longrope,
            sliding_window=16, tie_word_embeddings=False,
        )  # fmt: skip
    elif kind == "qwen3-moe":  # q/k norms, renormalized top 2 of 8, the middle layer dense (`mlp_only_layers`)
        config = tf.Qwen3MoeConfig(
            **{**SMALL, "num_hidden_layers": 3}, head_dim=16, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False,
        )  # fmt: skip
    elif kind == "qwen2-moe":  # q|k|v biases, top 2 of 8 as they are, the shared expert and its sigmoid gate
        config = tf.Qwen2MoeConfig(  # weights a little larger: sharper logits, so sampled text repeats
            **{**SMALL, "initializer_range": 0.4}, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=False, shared_expert_intermediate_size=48, use_sliding_window=False,
            tie_word_embeddings=False,
        )  # fmt: skip
    elif kind == "mixtral":  # top 2 of 4, always renormalized
        config = tf.MixtralConfig(
            **SMALL, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
            tie_word_embeddings=False,
        )  # fmt: skip
    elif kind == "olmoe":  # q/k norms over the whole projections, q, k and v clipped, top 3 of 8
        config = tf.OlmoeConfig(
            **SMALL, num_experts=8, num_experts_per_tok=3, clip_qkv=1.5, norm_topk_prob=False,
            tie_word_embeddings=False,
        )  # fmt: skip
    elif kind == "gpt-oss":  # sinks, biases everywhere, top 2 of 4 logits then softmax, a clamp that bites, YaRN
        config = tf.GptOssConfig(
            **{**SMALL, "intermediate_size": 32}, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=8, swiglu_limit=1.0, tie_word_embeddings=False,
        )  # fmt: skip
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():  # biases start at zero: give them values, so a dropped bias shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.3)
            elif kind.startswith("gemma") and name.endswith("norm.weight"):  # (1 + w): zero would hide a lost 1
                p.uniform_(-0.5, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):  # not ones: a dropped norm shows
                p.uniform_(0.5, 1.5)
            elif name.endswith("sinks"):  # large enough to take a share of every softmax
                p.uniform_(-1.0, 2.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


KINDS = [
    "llama",
    "llama3-rope-bias-tied",
    "mistral",
    "qwen2",
    "qwen3",
    "mistral-window",
    "qwen2-window",
    "gemma2",
    "gemma3",
    "phi3",
]


def _core(model: Any, impl: str) -> EngineCore:
    from batchserve.config import CacheConfig, DraftConfig, EngineConfig, ModelConfig, SchedulerConfig

    config = EngineConfig(
        model=ModelConfig(model_impl=impl),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
        draft=DraftConfig(decoding_length=8, adaptive=False),
    )
    return EngineCore(config, model, make_tiny_tokenizer())


def _all_logits(core: EngineCore, prompts: list[list[int]]) -> torch.Tensor:
    """Every row's logits of one packed prefill of `prompts` (each in its own blocks)."""
    runner = core.runner
    items, block = [], 0
    for i, p in enumerate(prompts):
        n = -(-len(p) // 4)
        blocks = tuple(range(block, block + n))
        items.append(ScheduledRequest(f"r{i}", tuple(p), 0, blocks, None, True, SamplingParams()))
        block += n
    step = pack(items, runner._tables, 4)
    ids, pos, slots, _ = runner._to_device(step.input_ids, step.positions, step.slot_mapping, step.keep)
    metadata = runner.backend.build_metadata(step.layout, slots)
    keep = torch.arange(len(step.input_ids))
    with torch.inference_mode():
        out = runner.model(input_ids=ids[None], position_ids=pos[None], logits_to_keep=keep, attn_metadata=metadata)
    runner.release([it.request_id for it in items])
    return out.logits[0]  # [T, V]


@pytest.mark.parametrize("kind", KINDS)
def test_native_logits_equal_transformers_on_every_packed_row(kind):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, TINY_VOCAB, n).tolist() for n in (7, 1, 23, 12)]
    hf = _core(_model(kind), "transformers")
    native = _core(_model(kind), "native")
    assert isinstance(native.runner.model, NativeLlamaForCausalLM)
    expected, got = _all_logits(hf, prompts), _all_logits(native, prompts)
    assert got.shape == expected.shape == (43, TINY_VOCAB)
    # Both are float32 evaluations of one model whose products and norms sum in different orders
    # (oneDNN or torch's BLAS, the CPU's vector width): each is held to the exact logits (the model
    # in float64) by what HF's float32 order is off on this CPU, not to the other by a fixed number
    # (tests/rounding.py). Elements are scaled by sum |w||h| of their LM-head product.
    exact, scale = float64_logits(_model(kind), prompts)
    bound = assert_rounds_like(got, expected, exact, scale)
    # ... tight enough to see a mistake far smaller than a real one: the softmax scale 1e-4 off.
    for layer in native.runner.model.layers:
        layer.self_attn.scaling *= 1 + 1e-4
    assert rounding_units(_all_logits(native, prompts), exact, scale) > 2 * bound


@pytest.mark.parametrize("kind", KINDS)
def test_native_greedy_with_drafts_equals_hf_generate(kind):
    model = _model(kind)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, TINY_VOCAB, n).tolist() for n in (5, 17, 30)]
    expected = [hf_greedy(model, p, 24, ignore_eos=True) for p in prompts]
    # Trees mixing the true continuation with wrong branches: accepted and rejected rows both.
    drafter = OracleDrafter({tuple(p): e for p, e in zip(prompts, expected)}, seed=3, vocab=TINY_VOCAB)
    llm = LLM(
        hf_model=_model(kind),
        tokenizer=make_tiny_tokenizer(),
        drafter=drafter,
        model_impl="native",
        adaptive=False,
        max_num_batched_tokens=1024,
    )
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert all(o.stats.draft_tokens_accepted for o in outs)


def test_what_the_native_forward_does_not_run_exactly_is_refused_by_name():
    import transformers as tf

    proportional = tf.LlamaConfig(**SMALL, rope_scaling={"rope_type": "proportional", "factor": 2.0})
    assert "rope type proportional" in (supports(proportional) or "")
    gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32))
    with pytest.raises(ValueError, match="model type gpt2"):
        native_from_hf(gpt2)
    assert choose_impl(gpt2, "transformers") is gpt2 and choose_impl(gpt2, "auto") is gpt2
    assert supports(_model("llama").config) is None
    assert isinstance(choose_impl(_model("llama"), "auto"), NativeLlamaForCausalLM)  # the CPU default
    assert not isinstance(choose_impl(_model("llama"), "transformers"), NativeLlamaForCausalLM)


def test_a_mixture_of_experts_off_the_cpu_runs_on_transformers_modules_and_says_so(caplog, monkeypatch):
    """No MoE kernels of ours off the CPU: `auto` keeps transformers' modules there and logs it
    (the meta device stands in for a GPU here), but for gpt-oss, whose sinks only our forward
    computes; on the CPU the native forward runs them all."""
    moe = _model("qwen3-moe")
    assert isinstance(choose_impl(moe, "auto"), NativeLlamaForCausalLM)
    off = moe.to("meta")
    with caplog.at_level(logging.INFO, logger="batchserve"):
        assert choose_impl(off, "auto") is off
    assert "mixture-of-experts layers on meta run on transformers' modules" in caplog.text
    with caplog.at_level(logging.INFO, logger="batchserve"), monkeypatch.context() as m:  # gpt-oss: sinks
        m.setattr(batchserve.model, "NATIVE_DEVICES", ("cpu", "meta"))  # meta as the native forward's GPU
        assert isinstance(choose_impl(_model("gpt-oss").to("meta"), "auto"), NativeLlamaForCausalLM)
        choose_impl(_model("llama").to("meta"), "auto")  # a dense model: no line
    assert "its sinks need our forward on meta" in caplog.text and caplog.text.count("mixture-of-experts") == 1


def test_a_native_model_handed_in_is_reused_as_it_is():
    native = choose_impl(_model("llama"), "auto")
    assert choose_impl(native, "auto") is native and choose_impl(native, "native", cpu_weights="float32") is native
    with pytest.raises(ValueError, match="cannot run as transformers"):
        choose_impl(native, "transformers")
    with pytest.raises(ValueError, match="cannot run as auto/gguf"):
        choose_impl(native, "auto", cpu_weights="gguf")


def test_gguf_weights_over_a_model_not_loaded_from_a_gguf_file_are_refused_saying_why():
    # (Over one that was, they read the file again from its blocks: tests/model/test_cpu_weights.py.)
    for impl in ("auto", "transformers"):
        with pytest.raises(ValueError, match=r"reads a GGUF file's own blocks.*not loaded from a GGUF file"):
            choose_impl(_model("llama"), impl, cpu_weights="gguf")


def test_a_native_model_built_on_a_gpu_is_reused_with_the_default_weights():
    # Off the CPU a native model's weights are its dtype ("-"): the bench reuses such a model with
    # cpu_weights=float32 (the CLI default), which must not refuse it; CPU weights still must.
    native = choose_impl(_model("llama"), "native")
    native.cpu_weights = "-"
    assert choose_impl(native, "native", cpu_weights="float32") is native
    assert choose_impl(native, "auto", cpu_weights="auto") is native
    with pytest.raises(ValueError, match="cannot run as native/gguf"):
        choose_impl(native, "native", cpu_weights="gguf")


def test_bf16_weights_make_every_product_a_bf16_layer_of_a_float32_model():
    from batchserve.model.bf16 import KernelBf16Linear, our_bf16_here
    from batchserve.model.layers import Bf16Linear, bf16_prepack_available, packed_products_invariant

    if not our_bf16_here() and not bf16_prepack_available():
        with pytest.raises(ValueError, match="prepacked bfloat16"):
            choose_impl(_model("llama"), "auto", cpu_weights="bfloat16")
        return
    # Our kernel wherever it builds; oneDNN's only where ours cannot be built.
    layer_class = KernelBf16Linear if our_bf16_here() else Bf16Linear
    native = choose_impl(_model("llama"), "auto", cpu_weights="bfloat16")
    linears = [m for m in native.modules() if isinstance(m, torch.nn.Linear | Bf16Linear | KernelBf16Linear)]
    assert linears and all(type(m) is layer_class for m in linears)  # the LM head too
    # Only the products whose output enters the residual add alone leave in bfloat16.
    narrow = {name for name, m in native.named_modules() if getattr(m, "out_dtype", None) == torch.bfloat16}
    residual = ("self_attn.o_proj", "mlp.down_proj")
    assert narrow == {f"layers.{i}.{p}" for i in range(len(native.layers)) for p in residual}
    invariant = layer_class is KernelBf16Linear or packed_products_invariant(Bf16Linear)
    assert native.cpu_weights == "bfloat16" and native.batch_invariant_linears == invariant
    assert next(native.parameters()).dtype == torch.float32  # norms, residuals, attention
    with pytest.raises(ValueError, match="prepacked bfloat16"):
        choose_impl(_model("llama"), "auto", cpu_linear="torch", cpu_weights="bfloat16")
    with pytest.raises(ValueError, match="on CPU, loaded in float32"):
        choose_impl(_model("llama"), "transformers", cpu_weights="bfloat16")


def test_fused_projections_hold_the_same_weights():
    hf = _model("qwen2")
    native = native_from_hf(hf)
    attn, ours = hf.model.layers[1].self_attn, native.layers[1].self_attn
    q, _, v = ours.qkv_proj.weight.split(ours.qkv_proj.sizes)
    assert torch.equal(q, attn.q_proj.weight) and torch.equal(v, attn.v_proj.weight)
    assert torch.equal(ours.qkv_proj.bias.split(ours.qkv_proj.sizes)[1], attn.k_proj.bias)
    gate, up = native.layers[0].mlp.gate_up_proj.weight.chunk(2)
    mlp = hf.model.layers[0].mlp
    assert torch.equal(gate, mlp.gate_proj.weight) and torch.equal(up, mlp.up_proj.weight)
    assert native.lm_head.weight is native.embed_tokens.weight  # tied stays tied


def test_each_forward_has_its_own_cost_profile():
    from batchserve.runner.profile_key import profile_key

    native, hf = _core(_model("llama"), "native"), _core(_model("llama"), "transformers")
    assert profile_key(native.runner) != profile_key(hf.runner)
    assert "-native-" in profile_key(native.runner) and "-hf-" in profile_key(hf.runner)


def test_each_layer_gets_the_window_and_cap_transformers_applies():
    import transformers as tf

    assert layer_attention(_model("mistral-window").config) == (LayerAttention(8),) * 2
    assert layer_attention(_model("qwen2-window").config) == (LayerAttention(), LayerAttention(8))  # max_window_layers
    assert layer_attention(_model("qwen3").config) == (LayerAttention(),) * 2  # use_sliding_window=False
    gemma2 = tf.Gemma2Config(**{**SMALL, "num_hidden_layers": 3}, sliding_window=16)
    assert layer_attention(gemma2) == (LayerAttention(16, 50.0), LayerAttention(None, 50.0), LayerAttention(16, 50.0))
    # The context is the model's, not the window's: a window is applied, not avoided.
    llm = LLM(hf_model=_model("mistral-window"), tokenizer=make_tiny_tokenizer(), adaptive=False)
    assert llm.engine.facts.max_model_len == 1024


def test_longrope_runs_within_its_original_context_and_no_further():
    """Past its original context LongRoPE's factors (and dynamic NTK's base) follow a forward's
    longest position (a batch's, a draft tree's): the context is capped there, where every token
    gets the short factors."""
    assert rope_limit(_model("phi3").config) == 64 and rope_limit(_model("llama").config) is None
    import transformers as tf

    dynamic = tf.LlamaConfig(**SMALL, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert supports(dynamic) is None and rope_limit(dynamic) == 1024  # dynamic NTK: plain rope until then
    llm = LLM(hf_model=_model("phi3"), tokenizer=make_tiny_tokenizer(), adaptive=False)
    assert llm.engine.facts.max_model_len == 64
    with pytest.raises(ValueError, match="LongRoPE switches factors"):
        LLM(hf_model=_model("phi3"), tokenizer=make_tiny_tokenizer(), max_model_len=100)
