"""Routed experts for the native forward (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss): a family option
(`Routing`, read from the config), not a model class of its own. A sparse layer's MLP is a
`SparseMoE`: a router product, the top-k experts of each row, each expert an `MLP` of its own
products (the same layer classes as a dense MLP's: `BlockLinear` over a GGUF file's blocks,
oneDNN's or our bfloat16 product over an HF directory's weights), and the weighted sum.

Batch-invariant by construction: a row's router logits come from a row-wise product, its softmax
and top-k from row-wise ops (ties to the lower expert index: a stable sort); each expert's
products run over the rows that chose it, on kernels that give a row the same bits in a call of
any row count; and each row's weighted outputs are added in ascending expert order, the order
transformers adds them in, whatever the other rows chose. So a row's bits depend on its own
activations alone, as the dense layers' do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from batchserve import kernels
from batchserve.model.blocks import BlockLinear
from batchserve.model.layers import ROW_BUCKETS, ClampedSwiGLU, KernelSiluAndMul, MergedLinear
from batchserve.threads import rows_whole

# transformers' model_type of the routed-expert families the native forward runs
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss")
ALWAYS_RENORMALIZED = ("mixtral",)  # its router divides the top-k by their sum, with no option to turn it off
MOST_EXPERTS_PER_ROW = 64  # csrc/moe.cpp's sum


@dataclass(frozen=True, slots=True)
class Routing:
    """How a model's sparse layers route: `top_k` of `experts` by the softmax of the router's
    logits (renormalized over the chosen where `renormalize`), each expert an MLP of
    `intermediate` features, plus a shared expert of `shared_intermediate` features behind a
    sigmoid gate (Qwen2-MoE) where it is not None."""

    experts: int
    top_k: int
    renormalize: bool
    intermediate: int
    shared_intermediate: int | None
    sparse_step: int  # every sparse_step-th layer is sparse (Qwen's `decoder_sparse_step`)
    dense_layers: tuple[int, ...]  # layers kept dense (Qwen's `mlp_only_layers`)
    # gpt-oss: the top k of the router's logits first, then the softmax over them; biases on the
    # router and the experts' products; the experts' clamped SwiGLU (`ClampedSwiGLU`).
    softmax_first: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.experts or self.intermediate < 1:
            raise ValueError(
                f"routing {self.top_k} of {self.experts} experts of {self.intermediate} features (1 <= k <= experts)"
            )

    @classmethod
    def of(cls, config: Any) -> Routing | None:
        """The config's routing; None for a dense model."""
        if config.model_type not in MOE_ARCHITECTURES:
            return None
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        if not experts:
            return None
        shared = getattr(config, "shared_expert_intermediate_size", None) if config.model_type == "qwen2_moe" else None
        oss = config.model_type == "gpt_oss"
        return cls(
            experts=int(experts),
            top_k=int(config.num_experts_per_tok),
            renormalize=config.model_type in ALWAYS_RENORMALIZED or bool(getattr(config, "norm_topk_prob", False)),
            intermediate=int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size),
            shared_intermediate=int(shared) if shared else None,
            sparse_step=int(getattr(config, "decoder_sparse_step", None) or 1),
            dense_layers=tuple(getattr(config, "mlp_only_layers", None) or ()),
            softmax_first=not oss,
            router_bias=oss,
            expert_bias=oss,
            swiglu_limit=float(config.swiglu_limit) if oss else None,
            swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
        )

    def sparse(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx`'s MLP is routed experts (else the dense MLP)."""
        return layer_idx not in self.dense_layers and (layer_idx + 1) % self.sparse_step == 0

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), each row's
        own: softmax over every expert, the k largest (equal ones: the lower index first), divided
        by their sum where `renormalize`; or (`softmax_first` off) the k largest logits, then the
        softmax over those k."""
        with rows_whole(logits.shape[0], logits.shape[1]):
            scores = torch.softmax(logits.float(), dim=-1) if self.softmax_first else logits.float()  # [T, E]
            ordered, ids = torch.sort(scores, dim=-1, descending=True, stable=True)  # stable: ties keep index order
            weights, ids = ordered[:, : self.top_k], ids[:, : self.top_k]  # [T, k]
            if not self.softmax_first:
                weights = torch.softmax(weights, dim=-1)
            elif self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class SparseMoE(nn.Module):
    """A sparse layer's MLP: router (`gate`, [H] -> [E] logits), `experts` (E MLPs of the routing's
    intermediate size), and where the model has one a shared expert with its sigmoid gate, whose
    one logit is the router product's last output ([H] -> [E + 1]): one product, not a product of
    one column (whose kernel a library may pick by the row count)."""

    # The start-up check's rows (`runner.layer_check`): a row's routing and sum are its own, and
    # an expert's products take every path of their kernels within 64 rows (`BlockLinear`'s).
    check_rows = 64

    def __init__(self, config: Any, routing: Routing, mlp: Any) -> None:
        """`mlp(intermediate)`: a dense MLP of that many features (the expert's class)."""
        super().__init__()
        self.routing = routing
        shared = routing.shared_intermediate is not None
        sizes = (routing.experts, 1) if shared else (routing.experts,)
        self.gate = MergedLinear(config.hidden_size, sizes, routing.router_bias)
        self.experts = nn.ModuleList(mlp(routing.intermediate) for _ in range(routing.experts))
        self.shared_expert: nn.Module | None = mlp(routing.shared_intermediate) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H] float32: each row's experts' outputs times their weights, added in
        ascending expert order (plus the gated shared expert's)."""
        t, k = x.shape[0], self.routing.top_k
        logits = self.gate.forward(x)  # [T, E (+ 1)]
        weights, ids = self._route(logits)  # [T, k] each
        out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)  # [T, H]
        flat = ids.reshape(-1)  # [T k]
        # One sort groups the (row, slot) picks by expert, rows ascending within each (stable).
        order = torch.argsort(flat, stable=True)  # [T k]
        counts = torch.bincount(flat, minlength=self.routing.experts).tolist()
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            picks = order[start : start + n]  # [n] indices into the flat [T k] picks
            start += n
            rows = picks // k  # [n], ascending
            y = self.experts[expert].forward(x[rows]).float() * weights.reshape(-1)[picks, None]  # [n, H]
            out.index_add_(0, rows, y)  # each row once per expert: its sum runs in expert order
        return self._plus_shared(x, logits, out)

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's logits [T, E (+ 1)] -> each row's (weights, expert ids) [T, k]."""
        return self.routing.route(logits[:, : self.routing.experts])

    def _plus_shared(self, x: torch.Tensor, logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum `out` [T, H] plus the shared expert's output, if any, gated by
        the sigmoid of the router's last logit."""
        if self.shared_expert is None:
            return out
        shared = self.shared_expert.forward(x).float()  # [T, H]
        with rows_whole(x.shape[0], shared.shape[1]):
            return out + torch.sigmoid(logits[:, self.routing.experts :].float()) * shared

    def extra_repr(self) -> str:
        r = self.routing
        shared = f", shared expert of {r.shared_intermediate}" if r.shared_intermediate else ""
        return f"top {r.top_k} of {r.experts} experts{' renormalized' if r.renormalize else ''}{shared}"


class KernelClampedSwiGLU(ClampedSwiGLU):
    """gpt-oss's clamped SwiGLU in one call of our kernel (its own exp, as `KernelSiluAndMul`'s;
    beside our quantized products only). Row-wise, batch-invariant by construction."""

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return kernels.clamped_swiglu(gate_up.contiguous(), self.alpha, self.limit)


class KernelSparseMoE(SparseMoE):
    """A sparse layer whose experts all run on our kernels (`BlockLinear` products over a GGUF
    file's blocks, with or without float32 biases; our silu * up or clamped SwiGLU): the experts in
    one call of our kernel (`kernels.moe_experts`, csrc/moe.cpp), the same kernels in the same
    order as `SparseMoE.forward`'s loop, so the same bits without its Python calls per expert. The
    table holds the experts' descriptors' and biases' addresses: their tensors must not be replaced
    after it is built (the loader swaps this class in last)."""

    def __init__(self, moe: SparseMoE) -> None:
        nn.Module.__init__(self)
        why = why_not_kernel(moe)
        if why is not None:
            raise ValueError(why)
        self.routing, self.gate, self.experts = moe.routing, moe.gate, moe.experts
        self.shared_expert = moe.shared_expert
        rows = [[_address(t) for t in (e.gate_up_proj.desc, e.down_proj.desc, e.gate_up_proj.bias, e.down_proj.bias)]
                for e in moe.experts]  # fmt: skip  # each tensor kept alive by its product
        self.register_buffer("table", torch.tensor(rows, dtype=torch.int64), persistent=False)  # [E, 4]
        act = moe.experts[0].act
        self.clamp = (act.alpha, act.limit) if isinstance(act, KernelClampedSwiGLU) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float().contiguous()  # [T, H]
        logits = self.gate.forward(x)  # [T, E (+ 1)]
        weights, ids = self._route(logits)  # [T, k] each
        most = ROW_BUCKETS[-1]  # at most a checked call's rows at a time (`in_checked_rows`), each row its own
        parts = [
            kernels.moe_experts(x[s : s + most], ids[s : s + most].contiguous(), weights[s : s + most].contiguous(),
                                self.table, self.routing.intermediate, self.clamp)
            for s in range(0, x.shape[0], most)
        ]  # fmt: skip
        return self._plus_shared(x, logits, parts[0] if len(parts) == 1 else torch.cat(parts))

    def _route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`Routing.route`'s rules in one call of our kernel (csrc/router.cpp), each row on one thread."""
        r = self.routing
        return kernels.moe_route(logits.float().contiguous(), r.experts, r.top_k, r.softmax_first, r.renormalize)


class KernelRouter(nn.Module):
    """A router's product (and a shared expert's gate, its last output) in float32 on our kernel
    (csrc/router.cpp): each logit one fixed-order sum over the file's own floats, so a row's
    logits are its own in a call of any row count; one call where oneDNN's product pads rows to
    a bucket and costs ~100 us a layer at one row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape  # [E (+ 1), H]
        self.sizes = sizes
        self.register_buffer("weight", weight.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.router_logits(x.float().contiguous(), self.weight, self.bias)  # [T, E (+ 1)]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, float32, our kernel"


def why_not_kernel(moe: SparseMoE) -> str | None:
    """None if every expert of `moe` runs in `KernelSparseMoE`, else why not."""
    if not kernels.available():
        return kernels.unavailable_reason()
    if moe.routing.top_k > MOST_EXPERTS_PER_ROW:
        return f"{moe.routing.top_k} experts a row (the kernel sums at most {MOST_EXPERTS_PER_ROW})"
    acts = {(type(x.act), getattr(x.act, "alpha", None), getattr(x.act, "limit", None)) for x in moe.experts}
    for e, expert in enumerate(moe.experts):
        products = (expert.gate_up_proj, expert.down_proj)
        if any(type(p) is not BlockLinear or not _kernel_bias(p) for p in products):
            return f"expert {e}'s products are not products over GGUF blocks on our kernels with float32 biases"
        if type(expert.act) not in (KernelSiluAndMul, KernelClampedSwiGLU):
            return f"expert {e}'s activation is not our kernel's silu * up or clamped SwiGLU"
    if len(acts) > 1:
        return "the experts' activations differ (the kernel runs one for all)"
    return None


def _kernel_bias(product: BlockLinear) -> bool:
    """Whether the kernel adds `product`'s bias as its forward does: none, or float32 [N] contiguous."""
    b = product.bias
    return b is None or (b.dtype == torch.float32 and b.is_contiguous() and b.shape == (product.out_features,))


def _address(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def use_kernel_experts(model: nn.Module) -> int:
    """Swap each `SparseMoE` whose experts all run on our kernels for a `KernelSparseMoE`, in
    place; the number swapped. The experts' clamped SwiGLUs (gpt-oss's) go on our kernel first:
    the kernel runs that one, and the layer-by-layer path must give its bits."""
    if kernels.available():
        for moe in [m for m in model.modules() if type(m) is SparseMoE]:
            for expert in moe.experts:
                if type(expert.act) is ClampedSwiGLU:
                    expert.act = KernelClampedSwiGLU(expert.act.alpha, expert.act.limit)
    swaps = [(name, m) for name, m in model.named_modules() if type(m) is SparseMoE and why_not_kernel(m) is None]
    for name, moe in swaps:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, KernelSparseMoE(moe))
    return len(swaps)


def expert_weights(model_type: str, leaf: str, stacked: torch.Tensor) -> list[tuple[int, str, str, torch.Tensor]]:
    """transformers' stacked expert parameter `leaf` of `mlp.experts` -> (expert, our product, its
    parameter, value) for each expert. Qwen's, Mixtral's and OLMoE's are [E, out, in] weights;
    gpt-oss's gate|up is [E, in, 2I] with gate and up interleaved (ours: [2I, in], the gate's rows
    first), its down [E, I, out], and each has a bias [E, out]."""
    out: list[tuple[int, str, str, torch.Tensor]] = []
    for e, value in enumerate(stacked):
        if model_type != "gpt_oss":
            out.append((e, leaf, "weight", value))
        elif leaf == "gate_up_proj":
            out.append((e, leaf, "weight", torch.cat((value[:, ::2], value[:, 1::2]), dim=1).T))
        elif leaf == "gate_up_proj_bias":
            out.append((e, "gate_up_proj", "bias", torch.cat((value[::2], value[1::2]))))
        elif leaf == "down_proj":
            out.append((e, leaf, "weight", value.T))
        else:  # down_proj_bias
            out.append((e, "down_proj", "bias", value))
    return out
