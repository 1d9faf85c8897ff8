"""An HF directory read tensor by tensor into bfloat16 products: the same bits as transformers'
load with cpu_weights=bfloat16, without the float32 model."""

from __future__ import annotations

import pytest
import torch

from batchserve.config import CacheConfig, DraftConfig, EngineConfig, ModelConfig, SchedulerConfig
from batchserve.engine import EngineCore
from batchserve.model.bf16 import KernelBf16Linear, our_bf16_here
from batchserve.model.hf_native import FileEmbedding, load_hf_native
from tests.conftest import make_tiny_model, make_tiny_tokenizer
from tests.model.test_llama import _all_logits, _model

pytestmark = pytest.mark.skipif(not our_bf16_here(), reason="our bfloat16 kernel does not run here")


def _config(path: str, weights: str = "bfloat16", impl: str = "auto") -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(path=path, cpu_weights=weights, model_impl=impl),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
        draft=DraftConfig(decoding_length=8, adaptive=False),
    )


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [
        ("llama", torch.bfloat16),
        ("qwen2", torch.float32),
        ("qwen3", torch.float32),
        ("gemma2", torch.float32),  # (1 + w) norms folded as they are read
        ("gemma3", torch.float32),  # and the windowed layers' own rotary
        ("phi3", torch.float32),  # q|k|v and gate|up stored merged
        ("qwen3-moe", torch.float32),  # each expert's products, the router, a dense layer between
        ("qwen2-moe", torch.bfloat16),  # and the shared expert with its gate
        ("mixtral", torch.float32),  # its checkpoint's own names (block_sparse_moe, w1/w2/w3)
        ("olmoe", torch.float32),  # q/k norms over the whole projections
    ],
)
def test_a_directory_read_tensor_by_tensor_gives_the_transformers_path_bits(tmp_path, dtype, kind):
    extra = {"attention_bias": True} if kind == "llama" else {}
    model = make_tiny_model(seed=3, dtype=dtype, **extra)
    if kind.startswith(("gemma", "phi")) or kind in ("qwen3-moe", "qwen2-moe", "mixtral", "olmoe"):
        model = _model(kind).to(dtype)
    elif kind in ("qwen2", "qwen3"):
        import transformers

        config_class = getattr(transformers, f"{kind.capitalize()}Config")
        model_class = getattr(transformers, f"{kind.capitalize()}ForCausalLM")
        torch.manual_seed(3)
        config = config_class(**{k: v for k, v in model.config.to_dict().items() if k in config_class().to_dict()})
        config.model_type = kind
        model = model_class(config).to(dtype)
        with torch.no_grad():  # Qwen3's per-head q/k norms start at ones: values, so a lost one shows
            for name, p in model.named_parameters():
                if name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.uniform_(0.5, 1.5)
    model.save_pretrained(tmp_path)
    make_tiny_tokenizer().save_pretrained(tmp_path)
    native, _ = load_hf_native(tmp_path)
    assert isinstance(native.embed_tokens, FileEmbedding) and native.embed_tokens.weight.dtype == dtype
    assert all(isinstance(layer.self_attn.qkv_proj, KernelBf16Linear) for layer in native.layers)
    direct = EngineCore(_config(str(tmp_path)))
    assert direct.runner.model.cpu_weights == "bfloat16"
    assert isinstance(direct.runner.model.embed_tokens, FileEmbedding)  # read directly, not through transformers
    from batchserve.model import loader

    hf_model, tok = loader.load_model(str(tmp_path), "float32")
    legacy = EngineCore(_config(str(tmp_path)), hf_model, tok)
    assert not isinstance(legacy.runner.model.embed_tokens, FileEmbedding)
    prompts = [[5, 9, 33, 1, 200, 17], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    assert torch.equal(_all_logits(direct, prompts), _all_logits(legacy, prompts))


def test_float32_weights_keep_the_transformers_load(tmp_path):
    make_tiny_model().save_pretrained(tmp_path)
    make_tiny_tokenizer().save_pretrained(tmp_path)
    core = EngineCore(_config(str(tmp_path), weights="float32"))
    assert not isinstance(core.runner.model.embed_tokens, FileEmbedding)


def test_a_directory_without_safetensors_is_refused_by_name(tmp_path):
    make_tiny_model().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no safetensors"):
        load_hf_native(tmp_path)
