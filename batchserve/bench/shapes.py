"""Random-weight models of the sizes users run, built on the device from a shape: no download,
no tokenizer file. What `batchserve bench --shape` times.

SmolLM2-135M keeps a GPU launch-bound, a regime no H100 user is in: an 8B model's steps are spent
reading weights and, past the critical decoding length, in FLOPs. `build_model` builds the native
forward (`model/llama.py`, the one the engine runs, through `native_from_hf` as for any Llama:
`host.native_model`) of a shape with seeded small-normal weights, straight on the device in the
device's dtype; `hf_twin` is a transformers `LlamaForCausalLM` over the native model's weight
tensors (the HF peers' model: the same weights, no second copy); `synthetic_tokenizer` gives the
engine a tokenizer of the shape's vocabulary (ids are the words `t0`, `t1`, ...): timing sends
token ids and needs no real one.

Light to import (the CLI lists the shapes): torch and transformers load inside the functions.
"""

from __future__ import annotations

import copy
import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

# Tiny shapes fit any CPU; anything larger needs CUDA (`ModelShape.cpu_ok`).
CPU_MAX_PARAMS = 50_000_000


@dataclass(frozen=True, slots=True)
class ModelShape:
    """A Llama-family model's sizes: all a random-weight build needs."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 500_000.0
    max_position_embeddings: int = 8192
    rms_norm_eps: float = 1e-5
    init_std: float = 0.02  # weights ~ N(0, init_std); norm weights 1
    # What `bench/gguf_write.py` writes (llama.cpp's architecture, a tied output, q/k/v biases);
    # `build_model` and `config` always build an untied, bias-free Llama of these sizes.
    arch: str = "llama"
    tied_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None  # written for the windowed layers of gemma2/gemma3 files
    # Routed experts (written only: `build_model` builds dense models): every layer's MLP is
    # `experts` MLPs of `expert_intermediate` features, `experts_used` of them per token, plus a
    # shared expert of `shared_expert_intermediate` features where it is not 0 (Qwen2-MoE).
    experts: int = 0
    experts_used: int = 0
    expert_intermediate: int = 0
    shared_expert_intermediate: int = 0
    yarn: tuple[float, int] | None = None  # YaRN's factor and original context, written for gpt-oss

    def __post_init__(self) -> None:
        sizes = (self.hidden_size, self.num_hidden_layers, self.num_attention_heads, self.head_dim)
        if min(*sizes, self.num_key_value_heads, self.intermediate_size, self.vocab_size) < 1:
            raise ValueError(f"shape {self.name}: every size must be >= 1")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"shape {self.name}: query heads must be a multiple of KV heads")
        if self.experts and not (0 < self.experts_used <= self.experts and self.expert_intermediate > 0):
            raise ValueError(f"shape {self.name}: experts need 1..experts used per token and an expert size")

    @property
    def num_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attention = h * (self.num_attention_heads + 2 * self.num_key_value_heads) * d + self.num_attention_heads * d * h
        mlp = 3 * h * self.intermediate_size
        if self.experts:  # every expert's gate|up and down, the router, the shared expert and its gate
            mlp = self.experts * (3 * h * self.expert_intermediate + h) + 3 * h * self.shared_expert_intermediate
        layer = attention + mlp + 2 * h  # q|k|v, o, the MLP, two norms
        return self.num_hidden_layers * layer + 2 * self.vocab_size * h + h  # embedding, head (untied), final norm

    @property
    def cpu_ok(self) -> bool:
        """Small enough to build and run on a CPU (the path checked without a GPU)."""
        return self.num_params <= CPU_MAX_PARAMS

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    def config(self) -> Any:
        """transformers' `LlamaConfig` of this shape (no special tokens: random weights never end)."""
        from transformers import LlamaConfig

        config = LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            initializer_range=self.init_std,
            tie_word_embeddings=False,
            attention_bias=False,
            mlp_bias=False,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        config._name_or_path = f"random-{self.name}"  # names the cost profile (`profile_key`)
        return config


def _qwen25(name: str, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, inter: int) -> ModelShape:
    """A Qwen2.5 shape: its vocabulary, rope theta, context and norm epsilon, tied, with q/k/v biases."""
    return ModelShape(
        name, hidden, layers, heads, kv_heads, head_dim, inter, 151936, rope_theta=1e6,
        max_position_embeddings=32768, rms_norm_eps=1e-6, arch="qwen2", tied_embeddings=True, qkv_bias=True,
    )  # fmt: skip


def _qwen3_moe(
    name: str, hidden: int, layers: int, heads: int, kv: int, experts: int, used: int, inter: int
) -> ModelShape:
    """A Qwen3-MoE shape: head dim 128, its vocabulary, rope theta, context and norm epsilon, untied."""
    return ModelShape(
        name, hidden, layers, heads, kv, 128, 6144, 151936, rope_theta=1e6, max_position_embeddings=40960,
        rms_norm_eps=1e-6, arch="qwen3moe", experts=experts, experts_used=used, expert_intermediate=inter,
    )  # fmt: skip


def _qwen3_17b(name: str, arch: str) -> ModelShape:
    """Qwen3-1.7B's sizes, rope theta, context and norm epsilon, tied, written as `arch`."""
    return ModelShape(
        name, 2048, 28, 16, 8, 128, 6144, 151936, rope_theta=1e6, max_position_embeddings=40960,
        rms_norm_eps=1e-6, arch=arch, tied_embeddings=True,
    )  # fmt: skip


SHAPES = {
    s.name: s
    for s in (
        # Meta-Llama-3-8B's config.json: 8.03B parameters, 16.1 GB in bfloat16.
        ModelShape("llama3-8b", 4096, 32, 32, 8, 128, 14336, 128256),
        # Qwen2.5-0.5B/1.5B and Llama-3.2-3B's config.json (tied embeddings; Qwen: q/k/v biases).
        # Llama 3.2's rope scaling (llama3, factor 32) is left out: it changes no speed or size.
        _qwen25("qwen2.5-0.5b", 896, 24, 14, 2, 64, 4864),
        _qwen25("qwen2.5-1.5b", 1536, 28, 12, 2, 128, 8960),
        ModelShape(
            "llama3.2-3b", 3072, 28, 24, 8, 128, 8192, 128256, max_position_embeddings=131072, tied_embeddings=True
        ),
        # Qwen3-1.7B's config.json (per-head q/k norms, tied, no biases), and the same sizes as a
        # Llama file: what the q/k norms cost a step is the difference between the two.
        _qwen3_17b("qwen3-1.7b", "qwen3"),
        _qwen3_17b("qwen3-1.7b-as-llama", "llama"),
        # The same proportions (GQA 4:1, MLP 3.5x hidden, rope theta 500000) at a CPU test's size,
        # with FlashInfer's smallest head dim (64) so that it runs on a GPU too; wider weights than
        # 8B's spread the random logits (no near-ties between two forwards).
        ModelShape("llama3-tiny", 128, 2, 4, 1, 64, 448, 512, max_position_embeddings=1024, init_std=0.2),
        # Qwen3-30B-A3B's config.json (and Qwen3-Coder-30B-A3B's): 128 experts of 768, 8 per token,
        # 30.5B parameters of which 3.3B are read per token.
        _qwen3_moe("qwen3-30b-a3b", 2048, 48, 32, 4, 128, 8, 768),
        # gpt-oss-20b's config.json: 32 experts of 2880, 4 per token, 128-key windows on every other
        # layer, YaRN (factor 32 over 4,096), q/k/v biases (and o's, the router's, the experts'), sinks.
        ModelShape(
            "gpt-oss-20b",
            2880,
            24,
            64,
            8,
            64,
            2880,
            201088,
            rope_theta=150000.0,
            max_position_embeddings=131072,
            arch="gpt-oss",
            qkv_bias=True,
            sliding_window=128,
            experts=32,
            experts_used=4,
            expert_intermediate=2880,
            yarn=(32.0, 4096),
        ),
    )
}


def get_shape(name: str) -> ModelShape:
    """The shape called `name`; ValueError naming the known ones otherwise."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}: one of {', '.join(SHAPES)}")
    return SHAPES[name]


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA (what users serve), float32 on the CPU (where the engine takes a handed-in
    native model as it is: float32 weights)."""
    import torch

    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_model(
    shape: ModelShape, device: str | torch.device = "cuda", dtype: torch.dtype | None = None, seed: int = 0
) -> nn.Module:
    """The native model of `shape` with seeded random weights on `device` in `dtype` (default:
    `default_dtype`), built as the engine builds any Llama it serves (`native_from_hf`: its layer
    kernels chosen for the device), from a transformers model allocated there uninitialized and
    filled in place: an 8B build on a GPU takes seconds and never holds a host copy. At its peak
    the device holds three times the weights' bfloat16 bytes (transformers' copy beside the native
    model allocated in float32 before its cast: 48 GB for 8B), then one."""
    import torch

    from batchserve.bench.host import native_model

    if shape.experts:
        raise ValueError(f"shape {shape.name} has routed experts: write it as a file (--write-gguf), bench that file")

    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    if device.type == "cpu" and dtype != torch.float32:
        raise ValueError("on the CPU the engine runs a handed-in native model in float32")
    hf = _random_hf(shape, device, dtype, seed)
    model = native_model(hf)
    del hf  # the native model holds its own copy of every weight
    gc.collect()
    # What `choose_impl` records for a model it built: off the CPU the weights are the model's dtype.
    model.cpu_weights = "float32" if device.type == "cpu" else "-"
    model.cpu_weights_reason = f"random weights of shape {shape.name}"
    return model


def _random_hf(shape: ModelShape, device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    """transformers' model of `shape` on `device` in `dtype`: norms 1, every other weight
    N(0, init_std) from one seeded generator on the device."""
    import torch
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

    config = shape.config()
    with torch.device("meta"):
        hf = LlamaForCausalLM(config)
    hf = hf.to(dtype).to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for module in hf.modules():
            for p in module.parameters(recurse=False):
                if isinstance(module, LlamaRMSNorm):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, shape.init_std, generator=generator)
    hf.model.rotary_emb = LlamaRotaryEmbedding(config).to(device)  # its buffers: computed, not left empty
    return hf.eval()


def hf_twin(model: nn.Module) -> Any:
    """A transformers `LlamaForCausalLM` whose parameters are `model`'s own tensors (views of the
    merged q|k|v and gate|up products): the same weights, no second copy. `native_from_hf` read
    backwards. Its config is a copy (transformers sets its attention choice there)."""
    import torch
    from torch import nn
    from transformers import LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from batchserve.bench.host import packed_modules

    packed = packed_modules()
    config = copy.deepcopy(model.config)
    with torch.device("meta"):
        hf = LlamaForCausalLM(config)
    device = next(model.parameters()).device
    for name, _ in list(hf.named_parameters()):
        module_name, _, leaf = name.rpartition(".")
        ours = name.removeprefix("model.")
        parent, _, proj = ours.rpartition(".")[0].rpartition(".")
        if proj in packed:
            merged_name, part = packed[proj]
            merged = model.get_submodule(f"{parent}.{merged_name}")
            tensor = getattr(merged, leaf).detach().split(merged.sizes)[part]  # a view: rows of the merged weight
        else:
            tensor = model.get_parameter(ours).detach()
        setattr(hf.get_submodule(module_name), leaf, nn.Parameter(tensor, requires_grad=False))
    hf.model.rotary_emb = LlamaRotaryEmbedding(config).to(device)
    left = [n for n, t in (*hf.named_parameters(), *hf.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(f"hf_twin: no weights for {left}")
    hf.generation_config.eos_token_id = None  # random weights: every prompt runs to max_new_tokens
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def synthetic_tokenizer(vocab_size: int) -> Any:
    """A fast tokenizer whose ids 0..vocab_size-1 are the words `t0` ... (unknown words: `t0`),
    without special tokens: what the engine needs to detokenize a random model's output."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def random_prompts(vocab_size: int, num_prompts: int, length: int, seed: int = 0) -> list[list[int]]:
    """`num_prompts` prompts of `length` uniformly random token ids (seeded)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(length)] for _ in range(num_prompts)]
