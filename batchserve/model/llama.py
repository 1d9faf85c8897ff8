"""The native Llama-family forward (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 2 and 3, Phi-3,
and the routed-expert Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE and gpt-oss: `model.moe`): fused
q|k|v and gate|up projections, the residual add fused into RMSNorm, rotary at each packed row's own
position, attention through the step's backend (with each layer's sliding window and soft-cap:
`layer_attention`), and the LM head only for the rows kept. What sets a family apart is a
`Family` option (`model.family`). The norms, silu*up and rotary are layers of the kernels chosen
when the model is built (`LayerKernels`: torch's ops, or FlashInfer's fused kernels on CUDA).

Shape of one step: ids [T] -> embeddings [T, H] -> layers -> the kept rows [K, H] -> logits
[K, V]. No Python decision inside depends on the step's data (only on the model's shape).

Inside the model a submodule runs as `m.forward(x)`, not `m(x)`: `nn.Module.__call__` costs a few
microseconds for its hooks' bookkeeping, and a step makes about 300 such calls (benchmarks/README.md)."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

from batchserve.attention.base import LayerAttention
from batchserve.model.family import (
    GEMMA_ARCHITECTURES,
    Family,
    activation,
    head_dim,
    hf_rotaries,
    rope_types,
    stored_norm,
)
from batchserve.model.layer_kernels import TORCH_LAYERS, LayerKernels, choose_layer_kernels
from batchserve.model.layers import ClampedSwiGLU, GeluTanhAndMul, MergedLinear
from batchserve.model.moe import MOE_ARCHITECTURES, SparseMoE, expert_weights
from batchserve.threads import rows_whole

# transformers' model_type
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", *GEMMA_ARCHITECTURES, *MOE_ARCHITECTURES)
# Rope types whose frequencies are fixed at load. Dynamic NTK's and LongRoPE's are fixed within
# their original context (the plain frequencies, the short factors), where the engine caps them
# (`rope_limit`).
STATIC_ROPE = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
# transformers' parameter names -> (our merged module, its part): one product instead of several.
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "gate": ("gate", 0),  # a sparse layer's router, and its shared expert's gate as one more output
    "router": ("gate", 0),  # (gpt-oss's name)
    "shared_expert_gate": ("gate", 1),
}

# transformers' stacked expert parameters of `mlp.experts` (`moe.expert_weights`: each expert's products').
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")

# Products whose output only enters the residual add (RMSNorm's fused `x + residual`): a
# reduced-precision product hands them over in bfloat16, which the add widens exactly.
RESIDUAL_PRODUCTS = ("self_attn.o_proj", "mlp.down_proj")


def product_out_dtype(name: str) -> torch.dtype:
    """The dtype a bfloat16 product named `name` (a module path in the model) leaves in."""
    return torch.bfloat16 if name.endswith(RESIDUAL_PRODUCTS) else torch.float32


def supports(config: Any) -> str | None:
    """None if the native forward runs this model exactly as transformers does, else why not."""
    arch = getattr(config, "model_type", None)
    if arch not in SUPPORTED_ARCHITECTURES:
        return f"model type {arch} (native: {', '.join(SUPPORTED_ARCHITECTURES)})"
    for rope_type in rope_types(config):
        if rope_type not in STATIC_ROPE:
            return f"rope type {rope_type}"
    if Family.of(config).act == "unsupported":
        return f"activation {activation(config)}"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    return None


def rope_limit(config: Any) -> int | None:
    """The context past which the model's rotary is not one fixed table, else None. LongRoPE
    (Phi-3/4) switches from its short to its long factors once a forward's longest position passes
    its original context, and dynamic NTK raises its base there: in transformers by the whole
    forward, so the rotation a token gets would depend on the draft tree and the other requests
    beside it. Within that context every token gets the same table in any step: exact."""
    if not {"longrope", "dynamic"} & set(rope_types(config)):
        return None
    rope = getattr(config, "rope_scaling", None) or {}
    limit = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
    return int(limit or config.max_position_embeddings)


def layer_attention(config: Any, sinks: list[tuple[float, ...] | None] | None = None) -> tuple[LayerAttention, ...]:
    """Each layer's sliding window (a query at position p sees keys p - W + 1 .. p), attention
    soft-cap and sinks (`attention_sinks`), as transformers applies them: by its per-layer kinds
    where the config lists them (Gemma's, Qwen2's `max_window_layers`), else one window for every
    layer (Mistral's). The backends apply them (`AttentionBackend.set_layers`)."""
    window = getattr(config, "sliding_window", None) or None
    softcap = getattr(config, "attn_logit_softcapping", None) or None
    types = getattr(config, "layer_types", None)
    if types is not None:
        windows = [window if kind == "sliding_attention" else None for kind in types]
    else:
        windows = [window if getattr(config, "use_sliding_window", True) else None] * config.num_hidden_layers
    sinks = sinks or [None] * len(windows)
    return tuple(LayerAttention(None if w is None else int(w), softcap, s) for w, s in zip(windows, sinks, strict=True))


def attention_sinks(model: Any) -> list[tuple[float, ...] | None] | None:
    """Each layer's sink logits (gpt-oss's) of a native model, None for a model without them."""
    if not getattr(getattr(model, "family", None), "sinks", False):  # (a transformers model has no family)
        return None
    return [tuple(float(v) for v in layer.self_attn.sinks.detach().float().cpu()) for layer in model.layers]


class Output(NamedTuple):
    logits: torch.Tensor  # [1, K, V]: the kept rows' logits (the runner's contract with any model)


class Attention(nn.Module):
    """q|k|v in one product, rotary (the step's, `Rotary.for_step`), the backend's paged attention
    over the request's KV."""

    def __init__(self, config: Any, layer_idx: int, kernels: LayerKernels = TORCH_LAYERS) -> None:
        super().__init__()
        family = Family.of(config)
        self.layer_idx = layer_idx  # the backend's KV layer
        self.head_dim = d = head_dim(config)
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.scaling = family.scaling  # what the backend is told (FlashInfer plans with it)
        qkv_bias = bool(getattr(config, "attention_bias", False) or getattr(config, "qkv_bias", False))
        qkv_bias = qkv_bias or config.model_type == "qwen2"
        kv = self.num_kv_heads * d
        self.qkv_proj = MergedLinear(config.hidden_size, (self.num_heads * d, kv, kv), bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * d, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        # The values each q/k norm spans: a head (Qwen3, Gemma 3) or the whole projection (OLMoE).
        self.norm_spans = (self.num_heads * d, kv) if family.qk_norm_whole else (d, d)
        if family.qk_norm:
            self.q_norm, self.k_norm = (kernels.norm(span, config.rms_norm_eps) for span in self.norm_spans)
        self.clip = family.clip_qkv
        # gpt-oss: each query head's sink logit, which the backends apply (`layer_attention`)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads), requires_grad=False) if family.sinks else None

    def _normed_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """q|k|v [T, (Hq + 2 Hkv) * D] -> the same with q and k RMS-normed, each head over its D
        values (or, OLMoE, each whole projection: `norm_spans`); row-wise."""
        assert self.q_norm is not None and self.k_norm is not None
        t, d, hq, hkv = qkv.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=1)
        q_span, k_span = self.norm_spans
        q = self.q_norm.forward(q.reshape(-1, q_span)).reshape(t, hq * d)
        k = self.k_norm.forward(k.reshape(-1, k_span)).reshape(t, hkv * d)
        return torch.cat((q, k, v.to(q.dtype)), dim=1)

    def forward(self, x: torch.Tensor, rotary: Any, metadata: Any) -> torch.Tensor:
        t, hq = x.shape[0], self.num_heads
        qkv = self.qkv_proj.forward(x)  # [T, (Hq + 2 Hkv) * D]
        if self.q_norm is not None:
            qkv = self._normed_heads(qkv)
        if self.clip is not None:  # OLMoE's clip, after the norms
            qkv = qkv.clamp(-self.clip, self.clip)
        q, k, v = rotary.split_heads(qkv, hq, self.num_kv_heads, self.head_dim)  # [heads, T, D] each, q and k rotated
        out = metadata.backend.forward(self.layer_idx, q, k, v, metadata, self.scaling)  # [T, Hq, D]
        return self.o_proj.forward(out.reshape(t, hq * self.head_dim))


class MLP(nn.Module):
    """gate|up in one product, the activation, down: a dense layer's MLP, or one expert's of
    `intermediate` features (the config's by default)."""

    def __init__(
        self,
        config: Any,
        kernels: LayerKernels = TORCH_LAYERS,
        intermediate: int | None = None,
        bias: bool | None = None,
        act: nn.Module | None = None,
    ) -> None:
        """`bias`, `act`: an expert's own (gpt-oss's biases and clamped SwiGLU), else the config's."""
        super().__init__()
        bias = getattr(config, "mlp_bias", False) if bias is None else bias
        i = intermediate or config.intermediate_size
        self.gate_up_proj = MergedLinear(config.hidden_size, (i, i), bias=bias)
        if act is None:
            act = GeluTanhAndMul() if Family.of(config).act == "gelu_tanh" else kernels.act()
        self.act = act
        self.down_proj = nn.Linear(i, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(self.act.forward(self.gate_up_proj.forward(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_idx: int, kernels: LayerKernels = TORCH_LAYERS) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, kernels)
        routing = Family.of(config).moe
        self.mlp: nn.Module
        if routing is not None and routing.sparse(layer_idx):
            limit, alpha = routing.swiglu_limit, routing.swiglu_alpha
            expert = lambda i: MLP(  # noqa: E731
                config, kernels, i, routing.expert_bias, None if limit is None else ClampedSwiGLU(alpha, limit)
            )
            self.mlp = SparseMoE(config, routing, expert)
        else:
            self.mlp = MLP(config, kernels)
        self.input_layernorm = kernels.norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = kernels.norm(config.hidden_size, config.rms_norm_eps)
        family = Family.of(config)
        self.sandwich = family.sandwich_norms
        if self.sandwich:  # Gemma: the attention's output normed on its own, the MLP's input and output too
            self.pre_feedforward_layernorm = kernels.norm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = kernels.norm(config.hidden_size, config.rms_norm_eps)
        types = getattr(config, "layer_types", None)
        # Which of the step's rotations this layer takes (Gemma 3's sliding-window layers have their own).
        self.local_rope = family.local_rope and types is not None and types[layer_idx] == "sliding_attention"

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rotary: Any, metadata: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] (the last layer's output, or the embeddings) and the residual beside it (None
        for the first layer) -> this layer's output and residual. `rotary`: the step's rotation."""
        if residual is None:
            h, residual = self.input_layernorm.forward(x), x
        else:
            h, residual = self.input_layernorm.forward(x, residual)
        h = self.self_attn.forward(h, rotary, metadata)
        if self.sandwich:  # residual + norm(attn), then norm(mlp(norm(that))) for the next add
            h, residual = self.pre_feedforward_layernorm.forward(self.post_attention_layernorm.forward(h), residual)
            return self.post_feedforward_layernorm.forward(self.mlp.forward(h)), residual
        h, residual = self.post_attention_layernorm.forward(h, residual)
        return self.mlp.forward(h), residual


class NativeLlamaForCausalLM(nn.Module):
    """The whole model; `forward` takes the runner's packed step as transformers' model does
    (ids and positions with a batch dimension of 1, the kept rows, the attention metadata)."""

    native = True  # the runner hooks no attention into it: it calls the backend itself

    def __init__(
        self, config: Any, inv_freq: torch.Tensor, rope_scaling: float, kernels: LayerKernels = TORCH_LAYERS
    ) -> None:
        super().__init__()
        self.config = config
        self.family = family = Family.of(config)
        self.layer_kernels = kernels  # what the norms, silu*up and rotary run on, and why
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # Gemma's scale as its embedding applies it, rounded to float32 (not a buffer: the loaders
        # build the model on the meta device).
        self.embed_scale = float(torch.tensor(family.embed_scale or 1.0, dtype=torch.float32, device="cpu"))
        self.layers = nn.ModuleList(DecoderLayer(config, i, kernels) for i in range(config.num_hidden_layers))
        self.norm = kernels.norm(config.hidden_size, config.rms_norm_eps)
        self.rotary = kernels.rotary(inv_freq, rope_scaling)
        self.rotary_local: nn.Module | None = None  # the sliding-window layers' own (Gemma 3); set by the loader
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight
        # Every layer in one kernel call where all of them are ours (`model.fused`); set by the loader.
        self.fused_layers: nn.Module | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logits_to_keep: torch.Tensor,
        attn_metadata: Any,
        use_cache: bool = False,
    ) -> Output:
        x = self.embed_tokens.forward(input_ids[0])  # [T, H]
        if self.family.embed_scale is not None:
            x = x * self.embed_scale
        rotary = self.rotary.for_step(position_ids[0], x.dtype)  # once per step, for every layer
        local = rotary if self.rotary_local is None else self.rotary_local.for_step(position_ids[0], x.dtype)
        fused = self.fused_layers
        residual: torch.Tensor | None = None
        if fused is not None and fused.runs(attn_metadata):
            x, residual = fused.forward(x, rotary.cos, rotary.sin, attn_metadata)  # torch's `Rotary` beside it
        else:
            for layer in self.layers:
                x, residual = layer.forward(x, residual, local if layer.local_rope else rotary, attn_metadata)
        x, residual = x[logits_to_keep], residual[logits_to_keep]  # [K, H]: only the rows that sample
        h, _ = self.norm.forward(x, residual)
        logits = self.lm_head.forward(h)  # [K, V]
        cap = self.family.final_softcap
        if cap is not None:  # elementwise, each row on one thread (`rows_whole`)
            with rows_whole(logits.shape[0], logits.shape[1]):
                logits = torch.tanh(logits / cap) * cap
        return Output(logits[None])  # [1, K, V]


@torch.no_grad()
def native_from_hf(hf_model: Any, layer_kernels: LayerKernels | None = None) -> NativeLlamaForCausalLM:
    """The native model with `hf_model`'s weights (moved, not copied twice: the merged ones are
    new tensors, the rest are shared), on its device and in its dtype. Raises ValueError for a
    model it does not run exactly (see `supports`). `layer_kernels`: what its norms, silu*up and
    rotary run on; by default `choose_layer_kernels` for its device, dtype and shape (torch's ops
    on the CPU, FlashInfer's fused kernels on CUDA in 16-bit floats where flashinfer imports)."""
    config = hf_model.config
    why = supports(config)
    if why is not None:
        raise ValueError(f"the native forward does not support {why}")
    param = next(hf_model.parameters())
    (inv_freq, scaling), local = hf_rotaries(hf_model.model.rotary_emb)
    if layer_kernels is None:
        layer_kernels = choose_layer_kernels(param.device, param.dtype, head_dim(config), config.intermediate_size)
    # A partial rotary (Phi's: the first dims of each head) runs on torch's ops.
    rotaries = layer_kernels if 2 * inv_freq.numel() == head_dim(config) else TORCH_LAYERS
    with torch.device("meta"):
        model = NativeLlamaForCausalLM(config, torch.empty(0), 1.0, layer_kernels)
    model = model.to_empty(device=param.device).to(param.dtype)
    model.rotary = rotaries.rotary(inv_freq, scaling)  # float32 tables: after .to
    if local is not None:
        model.rotary_local = rotaries.rotary(*local)
    for rotary in (model.rotary, model.rotary_local):
        if rotary is not None:
            rotary.to(param.device)
            if param.device.type != "cpu":
                rotary.reserve(config.max_position_embeddings)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.embed_tokens.weight
    ours = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in hf_model.named_parameters():
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        module, _, leaf = name.rpartition(".")
        parent, _, proj = module.rpartition(".")
        if leaf in EXPERT_PARAMETERS and proj == "experts":  # every expert's in one tensor
            for e, product, param, value in expert_weights(config.model_type, leaf, tensor):
                getattr(model.get_submodule(f"{module}.{e}.{product}"), param).copy_(value)
                loaded.add(f"{module}.{e}.{product}.{param}")
        elif proj in PACKED_MODULES:
            merged, part = PACKED_MODULES[proj]
            model.get_submodule(f"{parent}.{merged}").load_part(part, leaf, tensor)
            loaded.add(f"{parent}.{merged}.{leaf}")
        else:
            ours[name].copy_(stored_norm(config, name, tensor))
            loaded.add(name)
    missing = set(ours) - loaded - ({"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set())
    if missing:
        raise ValueError(f"weights missing for {sorted(missing)}")
    model.generation_config = getattr(hf_model, "generation_config", None)
    return model.eval()
