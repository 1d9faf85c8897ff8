"""Lossless sampling: seeded outputs are identical with drafts on and off, and the sampled
distribution is the model's own."""

from __future__ import annotations

import random

import pytest
import torch

from batchserve import SamplingParams
from tests.conftest import TINY_VOCAB, tiny_llm
from tests.engine.drafters import OracleDrafter, RandomTreeDrafter

PROMPTS = [[random.Random(i).randrange(TINY_VOCAB) for _ in range(10 + 7 * i)] for i in range(8)]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=48, temperature=0.7, seed=11),
        SamplingParams(max_new_tokens=48, temperature=1.0, top_k=5, seed=12),
        SamplingParams(max_new_tokens=48, temperature=0.9, top_p=0.8, seed=13),
    ],
)
def test_seeded_sampling_identical_with_drafts_on_and_off(params):
    plain = tiny_llm(None, draft="none").generate(PROMPTS, params)
    truth = {tuple(p): r.token_ids for p, r in zip(PROMPTS, plain)}
    # Random trees: mostly rejected. Oracle trees: the sampled continuation, mostly accepted.
    random_drafts = tiny_llm(RandomTreeDrafter(3, TINY_VOCAB), decoding_length=32).generate(PROMPTS, params)
    oracle = tiny_llm(OracleDrafter(truth, 4, TINY_VOCAB, depth=8), decoding_length=32).generate(PROMPTS, params)
    for a, b, c in zip(plain, random_drafts, oracle, strict=True):
        assert len(set(a.token_ids)) > 5  # really sampled, not stuck on one token
        assert b.token_ids == a.token_ids
        assert c.token_ids == a.token_ids
        assert c.stats.draft_tokens_accepted > 0.6 * len(c.token_ids)


def test_same_seed_same_text_different_seed_different_text():
    llm = tiny_llm(None, draft="none")
    a, b, c = llm.generate(
        [PROMPTS[0]] * 3,
        [
            SamplingParams(max_new_tokens=32, temperature=1.0, seed=5),
            SamplingParams(max_new_tokens=32, temperature=1.0, seed=5),
            SamplingParams(max_new_tokens=32, temperature=1.0, seed=6),
        ],
    )
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def reference_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The warped distribution, written out plainly for one row in float64 (not the engine's code)."""
    x = logits.double() / temperature
    if top_k:
        x[x < x.sort(descending=True).values[top_k - 1]] = float("-inf")
    probs = torch.softmax(x, -1)
    if top_p < 1:
        mass, kept = 0.0, []
        for token in probs.argsort(descending=True).tolist():  # the smallest prefix reaching top_p
            kept.append(token)
            mass += float(probs[token])
            if mass >= top_p:
                break
        trimmed = torch.zeros_like(probs)
        trimmed[kept] = probs[kept]
        probs = trimmed
    return probs / probs.sum()


# Chi-square critical values at p = 0.001 by degrees of freedom.
CHI2_CRIT_001 = {3: 16.27, 4: 18.47, 7: 24.32, 9: 27.88}


@pytest.mark.parametrize(
    ("prompt_index", "temperature", "top_k", "top_p"),
    [
        (2, 1.0, 8, 1.0),
        (2, 0.8, 10, 1.0),
        (2, 1.5, 0, 0.6),
        # Small top-p supports whose last kept token is likely: a top-p cut one token short
        # loses a token drawn hundreds of times, one token long draws a token outside the warp.
        (0, 0.7, 0, 0.65),
        (0, 1.0, 6, 0.8),  # top-k first, then top-p over the renormalized k tokens
    ],
)
def test_first_token_distribution_matches_softmax(tiny_model, prompt_index, temperature, top_k, top_p):
    prompt = PROMPTS[prompt_index]
    with torch.no_grad():
        logits = tiny_model(torch.tensor([prompt])).logits[0, -1]
    expected = reference_probs(logits, temperature, top_k, top_p)
    support = set(torch.nonzero(expected).flatten().tolist())
    # The warp itself: top-k keeps k tokens, top-p the smallest prefix reaching p.
    if top_p < 1:
        x = logits.double() / temperature
        if top_k:
            x[x < x.sort(descending=True).values[top_k - 1]] = float("-inf")
        cum = torch.cumsum(torch.softmax(x, -1).sort(descending=True).values, 0)
        k = int((cum < top_p).sum()) + 1
        assert len(support) == k
        # The cut is not a float tie: the engine's float32 mass agrees on where it falls.
        assert abs(float(cum[k - 1]) - top_p) > 1e-3 and (k == 1 or abs(float(cum[k - 2]) - top_p) > 1e-3)
    else:
        assert len(support) == (top_k or TINY_VOCAB)

    n = 3000
    llm = tiny_llm(None, draft="none", max_num_seqs=64)
    params = [
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1, seed=s) for s in range(n)
    ]
    results = llm.generate([prompt] * n, params)
    counts = torch.zeros(TINY_VOCAB, dtype=torch.float64)
    for r in results:
        counts[r.token_ids[0]] += 1
    drawn = set(torch.nonzero(counts).flatten().tolist())
    assert drawn <= support, sorted(drawn - support)  # nothing outside the warp
    likely = {t for t in support if expected[t] * n >= 15}  # P(never drawn) < 1e-6 each
    assert likely <= drawn, sorted(likely - drawn)  # and nothing inside it missing
    # Pearson chi-square over the support (merging tokens expected < 5 times into one bin).
    exp = expected * n
    big = exp >= 5
    obs_bins = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp_bins = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = exp_bins > 0
    chi2 = float((((obs_bins - exp_bins) ** 2)[keep] / exp_bins[keep]).sum())
    dof = int(keep.sum()) - 1
    crit = CHI2_CRIT_001.get(dof, dof + 4.0 * (2 * dof) ** 0.5)  # ~p 0.001 for larger dof
    assert chi2 < crit, f"chi2={chi2:.1f} over {dof} dof"
    # And the most likely token is drawn about as often as its probability says.
    top = int(expected.argmax())
    assert abs(counts[top] / n - expected[top]) < 4 * (expected[top] * (1 - expected[top]) / n) ** 0.5
