"""A GGUF file's transformers config and tokenizer, built from the header our reader parsed
(`gguf_read`): one header reader for every file the native forward serves, and the config says
what llama.cpp reads from the same keys (a Phi model's partial rotary and LongRoPE factors, Gemma
2's soft-caps, a rope scaling), where transformers' own GGUF reader drops them.

The tokenizer is transformers' GGUF converter fed with our reader's values; `gguf_tokenizer`
then splits text as llama.cpp does (`match_llama_cpp`). Architectures the native forward does not
run are not built here: transformers' fallback load reads those files itself."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from batchserve.model.gguf_read import GGUFContents

# general.architecture -> transformers' model_type of the forward that runs it
LLAMA_CPP_ARCHS = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text", "phi3": "phi3",
    "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe", "gpt-oss": "gpt_oss",
}  # fmt: skip
# A `llama` file with routed experts is a Mixtral (llama.cpp runs both as one architecture).
LLAMA_WITH_EXPERTS = "mixtral"
# `{arch}.<key>` of a routed-expert file -> the config's attribute
EXPERT_KEYS = {
    "expert_count": "num_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
# Whether llama.cpp divides the chosen experts' weights by their sum (`build_moe_ffn`'s norm_w), by
# architecture, where the file has no `{arch}.expert_weights_norm`.
RENORMALIZED = {"llama": True, "qwen3moe": True, "qwen2moe": False, "olmoe": False}
# `{arch}.<key>` -> the config's attribute (llama.cpp's names: gguf-py's `Keys.LLM`/`Keys.Attention`)
ARCH_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}
SOFTCAPS = {"attn_logit_softcapping": "attn_logit_softcapping", "final_logit_softcapping": "final_logit_softcapping"}
SPECIAL_IDS = {"bos": "bos_token_id", "eos": "eos_token_id", "unknown": "unk_token_id", "padding": "pad_token_id"}
# tokenizer.ggml.<key> -> the special token's name in the tokenizer's arguments
SPECIAL_TOKENS = {"bos_token_id": "bos_token", "eos_token_id": "eos_token", "unknown_token_id": "unk_token",
                  "padding_token_id": "pad_token"}  # fmt: skip


def plain(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """key -> value (our reader's `MetaValue`s unwrapped)."""
    return {k: getattr(v, "value", v) for k, v in metadata.items()}


def config_dict(contents: GGUFContents) -> dict[str, Any]:
    """The transformers config (as a dict) of a file the native forward serves; ValueError for
    any other architecture."""
    meta = plain(contents.metadata)
    arch = str(meta.get("general.architecture", ""))
    if arch not in LLAMA_CPP_ARCHS:
        raise ValueError(f"architecture {arch or '(none)'} (read from blocks: {', '.join(LLAMA_CPP_ARCHS)})")
    names = {t.name for t in contents.tensors}
    config: dict[str, Any] = {"model_type": LLAMA_CPP_ARCHS[arch]}
    for key, attr in ARCH_KEYS.items():
        if f"{arch}.{key}" in meta:
            config[attr] = meta[f"{arch}.{key}"]
    config.update(_experts(meta, arch, names))
    config.setdefault("num_key_value_heads", config.get("num_attention_heads"))
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in meta:
        config["vocab_size"] = len(meta["tokenizer.ggml.tokens"])
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    plain_head = hidden // heads if heads and hidden else None
    head = meta.get(f"{arch}.attention.key_length")
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if head is None and arch == "llama":  # llama.cpp's Llama rotates every dim of a head
        head = rope_dims
    if head is not None:
        config["head_dim"] = int(head)
    config["tie_word_embeddings"] = "output.weight" not in names
    for key, attr in SPECIAL_IDS.items():
        if f"tokenizer.ggml.{key}_token_id" in meta:
            config[attr] = int(meta[f"tokenizer.ggml.{key}_token_id"])
    if arch.startswith("gemma"):
        for key, attr in SOFTCAPS.items():
            if f"{arch}.{key}" in meta:
                config[attr] = float(meta[f"{arch}.{key}"])
    elif arch == "phi3":
        config.update(_phi3(meta, contents, int(config.get("head_dim") or plain_head or 0), rope_dims))
    else:
        rope = _rope_scaling(meta, arch)
        if rope is not None:
            config["rope_scaling"] = rope
    return config


def _experts(meta: Mapping[str, Any], arch: str, names: set[str]) -> dict[str, Any]:
    """A routed-expert file's routing as the config names it (nothing for a dense file)."""
    if not meta.get(f"{arch}.expert_count"):
        return {}
    out: dict[str, Any] = {
        attr: int(meta[f"{arch}.{key}"]) for key, attr in EXPERT_KEYS.items() if f"{arch}.{key}" in meta
    }
    norm = meta.get(f"{arch}.expert_weights_norm")
    out["norm_topk_prob"] = bool(norm) if norm is not None else RENORMALIZED.get(arch, False)
    clamp = meta.get(f"{arch}.attention.clamp_kqv")
    if clamp:
        out["clip_qkv"] = float(clamp)
    if arch == "llama":
        out["model_type"] = LLAMA_WITH_EXPERTS
        out["num_local_experts"] = out.pop("num_experts")
    if arch == "gpt-oss":  # its config names the experts' count and width as Mixtral's does
        out["num_local_experts"] = out.pop("num_experts")
        out["intermediate_size"] = out.pop("moe_intermediate_size")
        out.pop("norm_topk_prob")
    if arch == "qwen2moe":
        out["qkv_bias"] = "blk.0.attn_q.bias" in names
    return out


def _rope_scaling(meta: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    """A linear or YaRN scaling the file names (`{arch}.rope.scaling.*`), as transformers takes it.
    Llama 3's scaling is not one of these: the file stores it as `rope_freqs` factors instead."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind not in ("linear", "yarn") or not factor or float(factor) == 1.0:
        return None
    rope: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "yarn" and original:
        rope["original_max_position_embeddings"] = int(original)
    return rope


def _phi3(meta: Mapping[str, Any], contents: GGUFContents, head_dim: int, rope_dims: Any) -> dict[str, Any]:
    """Phi-3/4's rotary: the share of each head it rotates (`rope.dimension_count`), and LongRoPE's
    short and long factors (the `rope_factors_*` tensors) with its original context and attention
    factor, as llama.cpp reads them."""
    out: dict[str, Any] = {}
    if rope_dims and head_dim and int(rope_dims) != head_dim:
        out["partial_rotary_factor"] = int(rope_dims) / head_dim
    factors = {t.name: t for t in contents.tensors}
    short, long = factors.get("rope_factors_short.weight"), factors.get("rope_factors_long.weight")
    original = meta.get("phi3.rope.scaling.original_context_length")
    if short is None or long is None or not original:
        return out
    rope: dict[str, Any] = {
        "rope_type": "longrope",
        "short_factor": _vector(contents, short).tolist(),
        "long_factor": _vector(contents, long).tolist(),
        "original_max_position_embeddings": int(original),
    }
    attn_factor = meta.get("phi3.rope.scaling.attn_factor")
    if attn_factor is not None and not math.isclose(float(attn_factor), 1.0):
        rope["attention_factor"] = float(attn_factor)
    out["original_max_position_embeddings"] = int(original)
    out["rope_scaling"] = rope
    return out


def _vector(contents: GGUFContents, entry: Any) -> np.ndarray:
    """A float32 tensor's values, read from the file at its offset (a few dozen floats)."""
    from gguf import GGMLQuantizationType

    if entry.qtype != GGMLQuantizationType.F32:
        raise ValueError(f"{entry.name} is {entry.qtype.name}, not F32")
    if contents.path is None:
        raise ValueError(f"{entry.name}: the file's path is unknown")
    count = int(np.prod(entry.ne))
    return np.fromfile(contents.path, dtype="<f4", count=count, offset=entry.offset).astype(np.float64)


def gguf_config(contents: GGUFContents) -> Any:
    """The transformers config object of `config_dict`."""
    from transformers import AutoConfig

    values = config_dict(contents)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def gguf_tokenizer(contents: GGUFContents, tokenizer_class: Any) -> Any:
    """The tokenizer the file's metadata describes, built as transformers builds one from a GGUF
    (its converter for `tokenizer.ggml.model`, special and user-defined tokens, BOS/EOS flags, the
    chat template) but from our reader's values, as `tokenizer_class`."""
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    meta = plain(contents.metadata)
    grouped = {
        group: {name: meta[f"tokenizer.{key}"] for key, name in renames.items() if f"tokenizer.{key}" in meta}
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    tokenizer_dict, tokenizer_config = grouped["tokenizer"], grouped["tokenizer_config"]
    if "tokens" not in tokenizer_dict:
        raise ValueError(f"{contents.path} has no vocabulary (tokenizer.ggml.tokens)")
    if tokenizer_dict.get("tokenizer_type") == "llama":  # llama.cpp adds BOS to a SentencePiece vocabulary by default
        tokenizer_config.setdefault("add_bos_token", True)
    tokens = tokenizer_dict["tokens"]
    for key, name in SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None
    backend, extra = convert_gguf_tokenizer(str(meta["general.architecture"]), tokenizer_dict)
    return tokenizer_class(tokenizer_object=backend, **tokenizer_config, **extra)
