"""Comparing float32 results that round differently for legitimate reasons.

Two float32 evaluations of the same math (torch's BLAS and oneDNN, our kernels and torch's ops,
AVX2's 8 lanes and AVX-512's 16) sum in different orders, so they differ by rounding, and by how
much depends on the CPU: a fixed tolerance between them passes or fails by where one CPU's
roundings happen to fall. Instead each is compared with the exact result (the same math in
float64, where float32 rounding is 2^29 times smaller), and the one under test may be off by what
float32 rounding in *some* order of the same operations is off, measured on this CPU, on these
inputs, with an order that is trusted:

    max |got - exact| / (u * scale)  <=  ORDER_FACTOR * max |trusted - exact| / (u * scale)

u is float32's unit roundoff. `scale`, per element, is the magnitude its rounding errors are
proportional to: for a product, sum |w| |x| over its terms (an error in any input or partial sum
reaches the result weighted by such terms), so an element whose terms cancel is not held to a
tolerance meant for large ones, nor a large one let off by one meant for small ones. The trusted
order's ratio is how much this computation amplifies rounding (its depth, norms, softmax); the
same operations in another order round by the same amount but not at the same places, so their
largest errors are samples of one size: ORDER_FACTOR (2) covers one landing above the other.
(Measured over 36 random tiny models on AVX-512 and AVX2 builds, 120 random attention steps and
12 sets of prompts: the tested order's largest error 0.5x to 1.53x the trusted order's, median
about 1.) A real mistake is not rounding: it grows with what it gets wrong, not with u (a softmax
scale 1e-4 off is 10x to 26x this bound in tests/model/test_llama.py; 1e-5 off, 11x to 23x in
tests/attention/test_kernel.py)."""

from __future__ import annotations

import copy
from typing import Any

import torch

U = 2.0**-24  # float32's unit roundoff: a rounding's relative error is at most this
ORDER_FACTOR = 2.0  # another summation order's largest error against the trusted order's (see above)
# A trusted float32 result further than this from its float64 twin (in units of u * scale) is not
# the same math rounded, and the comparison would bound nothing: these computations amplify
# rounding to tens of u, while one constant 1e-3 off already moves a tiny model's logits ~1e4 u.
SAME_MATH = 2.0**12


def rounding_units(x: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor) -> float:
    """max |x - exact| / (u * scale): x's largest error, in float32 roundings of each element's magnitude."""
    return ((x.double() - exact).abs() / (U * scale)).max().item()


def assert_rounds_like(got: torch.Tensor, trusted: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor) -> float:
    """`got` is off from `exact` by no more than float32 rounding in another order than `trusted`'s
    (see the module's docstring); returns the bound, in units of u * scale."""
    assert got.shape == trusted.shape == exact.shape == scale.shape
    assert (scale > 0).all()
    calibration = rounding_units(trusted, exact, scale)
    assert calibration < SAME_MATH, f"the float64 reference is not the trusted result's math ({calibration:.3g} u)"
    bound = ORDER_FACTOR * calibration
    error = rounding_units(got, exact, scale)
    assert error <= bound, f"{error:.1f} u off the exact result; float32 rounding: {calibration:.1f} u x{ORDER_FACTOR}"
    return bound


def _float64_rows(model64: Any, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [n, V], each logit's scale [n, V]) of one prompt through a float64 causal LM."""
    out = model64(input_ids=torch.tensor([prompt]), output_hidden_states=True)
    head = model64.get_output_embeddings().weight  # [V, H]
    return out.logits[0], out.hidden_states[-1][0].abs() @ head.abs().T  # the last hidden state: after the final norm


@torch.no_grad()
def float64_logits(model: Any, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """A transformers causal LM's logits of each prompt (alone, its own attention) in float64,
    every row of every prompt back to back [T, V], and each logit's scale [T, V]: sum_k |w_jk| |h_k|
    over its LM-head product (h the final norm's output), the terms any rounding upstream reaches
    it through. The model is copied, not changed."""
    model64 = copy.deepcopy(model).double()
    logits, scales = zip(*(_float64_rows(model64, p) for p in prompts))
    return torch.cat(logits), torch.cat(scales)


@torch.no_grad()
def prompt_logprobs_reference(model: Any, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every prompt token's logprob after the first, the prompts back to back [N]: (transformers'
    float32 forward and float32 log-softmax, a trusted order of the engine's arithmetic; the same in
    float64; each one's scale: a logprob l_t - logsumexp(l) moves by dl_t - sum_j p_j dl_j, so its
    token's logit scale plus the softmax-weighted mean of its row's). The model is not changed."""
    model64 = copy.deepcopy(model).double()
    trusted, exact, scale = [], [], []
    for p in prompts:
        tokens = torch.tensor(p[1:])[:, None]
        logits32 = model(torch.tensor([p])).logits[0, :-1]
        logits64, scale64 = (x[:-1] for x in _float64_rows(model64, p))
        trusted.append(torch.log_softmax(logits32, -1).gather(1, tokens)[:, 0])
        exact.append(torch.log_softmax(logits64, -1).gather(1, tokens)[:, 0])
        scale.append(scale64.gather(1, tokens)[:, 0] + (torch.softmax(logits64, -1) * scale64).sum(-1))
    return torch.cat(trusted), torch.cat(exact), torch.cat(scale)
