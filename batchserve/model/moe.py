"""Routed experts for the native forward (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): a family option
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

from batchserve.threads import rows_whole

# transformers' model_type of the routed-expert families the native forward runs
MOE_ARCHITECTURES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
ALWAYS_RENORMALIZED = ("mixtral",)  # its router divides the top-k by their sum, with no option to turn it off


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

    @classmethod
    def of(cls, config: Any) -> Routing | None:
        """The config's routing; None for a dense model."""
        if config.model_type not in MOE_ARCHITECTURES:
            return None
        experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
        if not experts:
            return None
        shared = getattr(config, "shared_expert_intermediate_size", None) if config.model_type == "qwen2_moe" else None
        return cls(
            experts=int(experts),
            top_k=int(config.num_experts_per_tok),
            renormalize=config.model_type in ALWAYS_RENORMALIZED or bool(getattr(config, "norm_topk_prob", False)),
            intermediate=int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size),
            shared_intermediate=int(shared) if shared else None,
            sparse_step=int(getattr(config, "decoder_sparse_step", None) or 1),
            dense_layers=tuple(getattr(config, "mlp_only_layers", None) or ()),
        )

    def sparse(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx`'s MLP is routed experts (else the dense MLP)."""
        return layer_idx not in self.dense_layers and (layer_idx + 1) % self.sparse_step == 0

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64), each row's
        own: softmax over every expert, the k largest (equal ones: the lower index first), divided
        by their sum where `renormalize`."""
        with rows_whole(logits.shape[0], logits.shape[1]):
            probs = torch.softmax(logits.float(), dim=-1)  # [T, E]
            ordered, ids = torch.sort(probs, dim=-1, descending=True, stable=True)  # stable: ties keep index order
            weights, ids = ordered[:, : self.top_k], ids[:, : self.top_k]  # [T, k]
            if self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, ids


class SparseMoE(nn.Module):
    """A sparse layer's MLP: router (`gate`, [H] -> [E] logits), `experts` (E MLPs of the routing's
    intermediate size), and where the model has one a shared expert with its sigmoid gate."""

    def __init__(self, config: Any, routing: Routing, mlp: Any) -> None:
        """`mlp(intermediate)`: a dense MLP of that many features (the expert's class)."""
        super().__init__()
        self.routing = routing
        hidden = config.hidden_size
        self.gate = nn.Linear(hidden, routing.experts, bias=False)
        self.experts = nn.ModuleList(mlp(routing.intermediate) for _ in range(routing.experts))
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Module | None = None
        if routing.shared_intermediate is not None:
            self.shared_expert = mlp(routing.shared_intermediate)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H] float32: each row's experts' outputs times their weights, added in
        ascending expert order (plus the gated shared expert's)."""
        t, k = x.shape[0], self.routing.top_k
        weights, ids = self.routing.route(self.gate.forward(x))  # [T, k] each
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
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert.forward(x).float()  # [T, H]
            with rows_whole(t, shared.shape[1]):
                out = out + torch.sigmoid(self.shared_expert_gate.forward(x).float()) * shared
        return out

    def extra_repr(self) -> str:
        r = self.routing
        shared = f", shared expert of {r.shared_intermediate}" if r.shared_intermediate else ""
        return f"top {r.top_k} of {r.experts} experts{' renormalized' if r.renormalize else ''}{shared}"
