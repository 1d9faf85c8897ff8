"""A GGUF file read straight from its blocks: the mapping of llama.cpp's tensors onto the native
model (checked with exact products against transformers' own dequantized load), each mix's
tensors on their own types, the refusals, the metadata cache."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from batchserve.bench.gguf_write import tensor_types, write_gguf
from batchserve.bench.shapes import ModelShape
from batchserve.config import CacheConfig, DraftConfig, EngineConfig, ModelConfig, SchedulerConfig
from batchserve.engine import EngineCore
from batchserve.model import blocks, gguf_file, gguf_memory, gguf_native
from batchserve.model.gguf_memory import GGUFTooLarge
from batchserve.model.gguf_native import GGUFEmbedding, load_gguf_native
from batchserve.model.gguf_read import read_gguf
from batchserve.model.gguf_tokenizer import match_llama_cpp
from batchserve.model.loader import default_model_path, load_model
from tests.model.test_llama import _all_logits

pytestmark = pytest.mark.skipif(not blocks.block_products_invariant(), reason="our block kernels do not run here")

# Small enough for a test, wide enough (256) for the K-quants; 96-wide tensors fall back per tensor.
TINY = ModelShape("tiny-llama", 256, 2, 4, 2, 64, 512, 49152, init_std=0.05)
TINY_QWEN = ModelShape(
    "tiny-qwen", 256, 2, 4, 2, 64, 512, 49152, init_std=0.05, arch="qwen2", tied_embeddings=True, qkv_bias=True
)
# Head dim 128, as every Qwen3 has (transformers reads a qwen3 file's head dim as its default, 128).
TINY_QWEN3 = ModelShape("tiny-qwen3", 256, 2, 4, 2, 128, 512, 49152, init_std=0.05, arch="qwen3")
# Gemma: tied, windowed layers (a 16-key window: the prompts below run past it), sandwich norms
# (the file's values already hold Gemma's + 1), Gemma 3's q/k norms and local rotary.
TINY_GEMMA2 = ModelShape(
    "tiny-gemma2", 256, 3, 4, 2, 64, 512, 49152, init_std=0.05, arch="gemma2", tied_embeddings=True, sliding_window=16
)
TINY_GEMMA3 = ModelShape(
    "tiny-gemma3", 256, 7, 4, 2, 64, 512, 49152, init_std=0.05, arch="gemma3", tied_embeddings=True, sliding_window=16
)


def _config(path: str | Path, weights: str = "auto", **model: object) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=str(path), cpu_weights=weights, **model),  # type: ignore[arg-type]
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
        draft=DraftConfig(decoding_length=8, adaptive=False),
    )


class ExactBlockLinear(nn.Module):
    """A stand-in for `BlockLinear` with the dequantized weights in float32 and torch's product:
    what transformers' load computes, so the model's mapping can be checked apart from our kernels."""

    def __init__(self, parts: list[blocks.BlockPart], bias: torch.Tensor | None, sizes: tuple[int, ...],
                 arena: object = None) -> None:  # fmt: skip
        super().__init__()
        from gguf import dequantize

        w = [np.asarray(dequantize(p.raw, p.qtype), np.float32).reshape(-1, p.cols) for p in parts]
        self.register_buffer("weight", torch.from_numpy(np.concatenate(w)))  # [N, K]
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() @ self.weight.T  # [T, N]
        return y if self.bias is None else y + self.bias


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    quants = ("Q4_K_M", "Q6_K", "Q4_0", "IQ4_XS", "IQ4_NL", "Q2_K")
    files = {f"llama-{q}": write_gguf(root / f"llama-{q}.gguf", TINY, q) for q in quants}
    files["qwen-Q5_K_M"] = write_gguf(root / "qwen-Q5_K_M.gguf", TINY_QWEN, "Q5_K_M")
    files["qwen3-Q4_K_M"] = write_gguf(root / "qwen3-Q4_K_M.gguf", TINY_QWEN3, "Q4_K_M")
    files["gemma2-Q4_K_M"] = write_gguf(root / "gemma2-Q4_K_M.gguf", TINY_GEMMA2, "Q4_K_M")
    files["gemma3-Q4_K_M"] = write_gguf(root / "gemma3-Q4_K_M.gguf", TINY_GEMMA3, "Q4_K_M")
    # Fewer than 6 layers: every layer windowed (transformers then makes no global rotary).
    short = dataclasses.replace(TINY_GEMMA3, name="tiny-gemma3-short", num_hidden_layers=4)
    files["gemma3short-Q4_K_M"] = write_gguf(root / "gemma3short-Q4_K_M.gguf", short, "Q4_K_M")
    return files


@pytest.mark.parametrize(
    "name", ["llama-Q4_K_M", "qwen-Q5_K_M", "qwen3-Q4_K_M", "gemma2-Q4_K_M", "gemma3-Q4_K_M", "gemma3short-Q4_K_M"]
)
def test_the_mapping_equals_transformers_load_of_the_same_file(tiny_files, monkeypatch, name):
    """With exact products, the native model read from the blocks (q/k rows un-permuted for
    llama, biases, tied head, norms, rope) computes transformers' float32 model of the file."""
    monkeypatch.setattr(blocks, "BlockLinear", ExactBlockLinear)
    native, tokenizer = load_gguf_native(tiny_files[name])
    hf, _ = load_model(tiny_files[name], "float32")
    prompts = [[5, 9, 33, 1, 200, 17], [7], list(range(40, 60))]
    # torch's float32 products claim no batch invariance: the torch attention, which claims none either.
    exact = {"model_impl": "native", "attention_backend": "torch"}
    got = _all_logits(EngineCore(_config(tiny_files[name], **exact), native, tokenizer), prompts)
    want = _all_logits(EngineCore(_config(tiny_files[name], model_impl="transformers"), hf, tokenizer), prompts)
    # Two float32 evaluations summing in different orders (and our norm kernel): close, not equal.
    assert torch.allclose(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))
    # ... and a slip in the mapping is far outside that: q's rows left permuted.
    monkeypatch.setattr(gguf_native, "PERMUTED_ARCHS", ())
    if name.startswith("llama"):
        wrong, _ = load_gguf_native(tiny_files[name])
        core = EngineCore(_config(tiny_files[name], **exact), wrong, tokenizer)
        assert not torch.allclose(_all_logits(core, prompts), want, rtol=0, atol=1e-2 * float(want.abs().max()))


@pytest.mark.parametrize(
    "name", ["llama-Q4_K_M", "llama-Q6_K", "llama-Q4_0", "llama-IQ4_XS", "llama-IQ4_NL", "llama-Q2_K", "qwen-Q5_K_M"]
)
def test_each_mix_runs_every_tensor_on_its_own_type(tiny_files, name):
    core = EngineCore(_config(tiny_files[name]))
    model = core.runner.model
    assert model.cpu_weights == "gguf" and isinstance(model.embed_tokens, GGUFEmbedding)
    assert core.facts.forward.impl.why.startswith("read straight from the GGUF file")
    planned = tensor_types(TINY_QWEN if name.startswith("qwen") else TINY, name.partition("-")[2])
    matrices = [n for n in planned if n.endswith(".weight") and "norm" not in n and n != "token_embd.weight"]
    tied = name.startswith("qwen")  # the head is the token embedding's blocks
    want = {planned[n].name for n in matrices} | ({planned["token_embd.weight"].name} if tied else set())
    assert set(model.gguf_report.native) == want and not model.gguf_report.dequantized
    layer = model.layers[0]
    for product in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(product, blocks.BlockLinear)
    assert model.batch_invariant_linears and core.facts.batch_invariant
    assert core.facts.eos_token_ids == {0, 2}  # its vocabulary's <|endoftext|> ends generation too, as in llama.cpp


def test_a_type_without_our_kernel_runs_as_bfloat16_and_says_so(tmp_path, caplog):
    path = write_gguf(tmp_path / "f16.gguf", TINY, "F16")
    with caplog.at_level(logging.INFO, logger="batchserve"):
        model, _ = load_gguf_native(path)
    assert len(model.gguf_report.dequantized) == 7 * TINY.num_hidden_layers + 1  # every matrix and the head
    assert "no kernel of ours for 15 tensors" in caplog.text and "bfloat16 copies" in caplog.text


def test_a_file_that_cannot_fit_is_refused_with_the_bytes_it_needs(tiny_files, monkeypatch):
    monkeypatch.setattr(gguf_memory, "available_bytes", lambda: 1 << 20)
    with pytest.raises(GGUFTooLarge, match=r"needs [\d,]+ bytes .* and 1,048,576 are available"):
        EngineCore(_config(tiny_files["llama-Q4_0"]))


def test_a_file_read_through_transformers_is_checked_for_memory_and_caches_nothing_larger(tmp_path, monkeypatch):
    """An architecture not read from its blocks (here: our kernels said unavailable) goes through
    transformers' float32 load: refused before loading where it cannot fit, and its float32
    conversion (larger than the Q4_0 file) is not written to the cache."""
    from batchserve.model import engine_model, loader

    path = write_gguf(tmp_path / "q4.gguf", TINY, "Q4_0")
    monkeypatch.setenv("BATCHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_native, "refusal", lambda tensors: "not read from blocks here (a test)")
    monkeypatch.setattr(gguf_memory, "available_bytes", lambda: 1 << 20)
    with pytest.raises(GGUFTooLarge, match=r"transformers' load of it dequantizes every weight to float32: it needs"):
        engine_model.load_engine_model(ModelConfig(path=str(path)))
    monkeypatch.setattr(gguf_memory, "available_bytes", lambda: None)
    model, _ = engine_model.load_engine_model(ModelConfig(path=str(path)))
    assert next(model.parameters()).dtype == torch.float32
    assert loader._cached_entry(path, "float32") is None  # 4x the file: not cached


def test_not_a_gguf_file_is_refused_by_name(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_gguf_native(bad)


def test_the_config_and_tokenizer_are_read_from_the_cache_on_a_second_start(tiny_files, monkeypatch, tmp_path):
    monkeypatch.setenv("BATCHSERVE_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    from batchserve.model import gguf_config

    built: list[str] = []
    real = gguf_config.gguf_config

    def counting(contents):  # type: ignore[no-untyped-def]
        built.append(contents.path.name)
        return real(contents)

    monkeypatch.setattr(gguf_config, "gguf_config", counting)
    path = tiny_files["llama-Q4_0"]
    first = gguf_file.read_meta(path)
    second = gguf_file.read_meta(path)
    assert built == [path.name]  # once, the first time
    assert first[0].to_dict() == second[0].to_dict()
    assert first[1]("hello world")["input_ids"] == second[1]("hello world")["input_ids"]
    path.touch()  # a changed file is read again
    gguf_file.read_meta(path)
    assert built == [path.name, path.name]


@pytest.mark.parametrize("name", ["llama-Q4_0", "qwen-Q5_K_M", "qwen3-Q4_K_M", "gemma2-Q4_K_M", "gemma3-Q4_K_M"])
def test_our_reader_builds_the_config_and_tokenizer_transformers_builds_from_the_file(
    tiny_files, monkeypatch, tmp_path, name
):
    """One header reader: the config and tokenizer come from the header `gguf_read` parsed (no
    transformers reader runs: an 8B's first start spent 6 s in it), and equal what transformers
    builds from the same file, its tokenizer with llama.cpp's splitting rules (`match_llama_cpp`)."""
    monkeypatch.setenv("BATCHSERVE_MODEL_CACHE_DIR", str(tmp_path / "cache"))
    from transformers import AutoConfig, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.integrations.gguf import gguf_tokenizer_mapping, reader

    path = tiny_files[name]
    want_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    want = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    assert match_llama_cpp(want, read_gguf(path).metadata).startswith("pre-tokenizer smollm")

    def no_reader(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("transformers read the file")

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", no_reader)
    monkeypatch.setattr(reader, "read_gguf_metadata", no_reader)
    monkeypatch.setattr(gguf_tokenizer_mapping, "read_gguf_metadata", no_reader, raising=False)
    config, got = gguf_file.read_meta(path)
    mine, theirs = config.to_dict(), want_config.to_dict()
    for key in ("_name_or_path", "_model_name_or_path", "transformers_version"):
        mine.pop(key, None), theirs.pop(key, None)
    assert mine == theirs
    assert type(got) is type(want)
    assert got.backend_tokenizer.to_str() == want.backend_tokenizer.to_str()
    assert (got.special_tokens_map, got.chat_template) == (want.special_tokens_map, want.chat_template)
    text = "def f(x):\n    return x  # <|im_end|> héllo"
    assert got(text)["input_ids"] == want(text)["input_ids"]


def test_a_transformers_loaded_default_model_asked_for_gguf_weights_reads_the_same_blocks():
    """SmolLM2's Q4_1 file read from its blocks by the engine, and the same file's transformers
    model handed in with cpu_weights=gguf (the bench's engines share one such model), compute the
    same logits bit for bit: the handed-in model is the file read again from its blocks."""
    path = default_model_path()
    direct = EngineCore(_config(path))
    assert direct.runner.model.cpu_weights == "gguf"
    hf, tokenizer = load_model(path, "float32")
    legacy = EngineCore(_config(path, weights="gguf"), hf, tokenizer)
    assert legacy.runner.model.cpu_weights == "gguf" and legacy.runner.model is not hf
    prompts = [tokenizer("def fibonacci(n):")["input_ids"], tokenizer("The capital of France is")["input_ids"]]
    assert torch.equal(_all_logits(direct, prompts), _all_logits(legacy, prompts))


def test_a_second_start_reuses_the_invariance_verdict_for_the_same_file_and_cpu(tiny_files, monkeypatch, tmp_path):
    from batchserve.runner import build

    monkeypatch.setenv("BATCHSERVE_CACHE_DIR", str(tmp_path / "cache"))
    checked: list[bool] = []
    real = build.check_contract

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        checked.append(True)
        return real(*args, **kwargs)

    monkeypatch.setattr(build, "check_contract", counting)
    path = tiny_files["llama-Q4_K_M"]
    first = EngineCore(_config(path)).facts.check
    second = EngineCore(_config(path)).facts.check
    assert len(checked) == 1 and first == second and first.invariant
    other = _config(path)
    EngineCore(dataclasses.replace(other, scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256)))
    assert len(checked) == 2  # another engine shape is another check ...
    path.touch()
    EngineCore(_config(path))
    assert len(checked) == 3  # ... and so is a changed file
    for _ in range(2):  # a model handed in, though read from the same file, is checked every time
        EngineCore(_config(path), *load_gguf_native(path))
    assert len(checked) == 5


def _phi3(vocab_size: int) -> nn.Module:
    """A tiny Phi-3 of transformers: half of each head rotated, LongRoPE past a 64-token original
    context, a 16-key window, untied; biases none (Phi-3 has none)."""
    import transformers as tf

    longrope = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 4.0], "long_factor": [8.0] * 4}
    config = tf.Phi3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, original_max_position_embeddings=64,
        partial_rotary_factor=0.5, rope_scaling=longrope, sliding_window=16, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).float().eval()


def _write_phi3(model: nn.Module, path: Path) -> Path:
    """`model` as llama.cpp's converter writes a Phi-3 (`Phi3MiniModel`): q|k|v and gate|up kept
    merged (attn_qkv, ffn_up), the rotated dims and LongRoPE's factors and attention factor in the
    metadata and `rope_factors_*` tensors; matrices in Q8_0. The model's weights become the values
    the file's blocks hold, so that it is the file's exact float32 model."""
    import math

    from gguf import GGMLQuantizationType, GGUFWriter, dequantize, quantize

    from batchserve.bench.gguf_write import _copy_tokenizer, default_gguf

    c, q8 = model.config, GGMLQuantizationType.Q8_0
    rope = c.rope_parameters
    heads, original = c.num_attention_heads, c.original_max_position_embeddings
    writer = GGUFWriter(str(path), "phi3")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_dimension_count(int(c.partial_rotary_factor * c.hidden_size) // heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_orig_ctx_len(original)
    scale = c.max_position_embeddings / original
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    writer.add_sliding_window(c.sliding_window or 0)
    _copy_tokenizer(writer, default_gguf(), c.vocab_size)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "self_attn.qkv_proj": "attn_qkv",
             "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            stem = name.removesuffix(".weight").removeprefix("model.")
            parts = stem.split(".")
            gguf_name = "output" if stem == "lm_head" else names.get(stem)
            if parts[0] == "layers":
                gguf_name = f"blk.{parts[1]}.{names['.'.join(parts[2:])]}"
            values = p.detach().numpy().astype(np.float32)
            if values.ndim == 1:
                writer.add_tensor(f"{gguf_name}.weight", values)
                continue
            blocks_ = quantize(values, q8)
            writer.add_tensor(f"{gguf_name}.weight", blocks_, raw_shape=blocks_.shape, raw_dtype=q8)
            p.copy_(torch.from_numpy(np.asarray(dequantize(blocks_, q8), np.float32).reshape(values.shape)))
    for kind in ("long", "short"):
        writer.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def phi3_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, nn.Module]:
    model = _phi3(len(read_gguf(default_model_path()).metadata["tokenizer.ggml.tokens"].value))
    return _write_phi3(model, tmp_path_factory.mktemp("phi3") / "phi3-Q8_0.gguf"), model


def test_a_phi3_file_reads_its_rotary_and_longrope_from_the_file(phi3_file):
    path, _ = phi3_file
    config, _ = gguf_file.read_meta(path)
    assert config.model_type == "phi3" and config.partial_rotary_factor == 0.5
    rope = config.rope_parameters
    assert rope["rope_type"] == "longrope" and rope["original_max_position_embeddings"] == 64
    assert rope["short_factor"] == [1.0, 1.5, 2.0, 4.0] and rope["long_factor"] == [8.0] * 4
    assert config.sliding_window == 16 and not config.tie_word_embeddings


def test_a_phi3_file_computes_its_transformers_model(phi3_file, monkeypatch):
    """Merged q|k|v and gate|up, half of each head rotated, LongRoPE's short factors, the window:
    with exact products the model read from the blocks computes transformers' Phi-3 of the same
    values; on our kernels every product runs on the file's blocks, batch-invariant."""
    path, hf = phi3_file
    prompts = [[5, 9, 33, 1, 200, 17], [7], list(range(40, 70))]  # past the 16-key window, within 64
    with monkeypatch.context() as m:
        m.setattr(blocks, "BlockLinear", ExactBlockLinear)
        native, tokenizer = load_gguf_native(path)
    exact = {"model_impl": "native", "attention_backend": "torch"}
    got = _all_logits(EngineCore(_config(path, **exact), native, tokenizer), prompts)
    want = _all_logits(EngineCore(_config(path, model_impl="transformers"), hf, tokenizer), prompts)
    assert torch.allclose(got, want, rtol=0, atol=1e-4 * float(want.abs().max()))
    core = EngineCore(_config(path))
    model = core.runner.model
    assert model.cpu_weights == "gguf" and set(model.gguf_report.native) == {"Q8_0"}
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, blocks.BlockLinear) and layer.self_attn.qkv_proj.sizes == (64, 32, 32)
    assert isinstance(layer.mlp.gate_up_proj, blocks.BlockLinear) and layer.mlp.gate_up_proj.sizes == (96, 96)
    assert core.facts.batch_invariant, core.facts.invariance_why
    # Our products quantize the activations to 8 bits (about 0.4% a product): 0.8% of the logits'
    # scale measured over the two layers, within 3%; a wrong mapping is off by the logits' size.
    ours = _all_logits(core, prompts)
    assert torch.allclose(ours, want, rtol=0, atol=0.03 * float(want.abs().max()))
