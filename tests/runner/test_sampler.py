"""The batched token choice: greedy rows, sampled rows, the warp and the CDF's edges."""

from __future__ import annotations

import random

import pytest
import torch

from batchserve import SamplingParams
from batchserve.request import MAX_INT32
from batchserve.runner.sampler import SampledRows, TreeRows, accept, accepted_path, choose_on_device, warp_rows
from batchserve.trees import DraftTree, walk
from tests.conftest import TINY_VOCAB, tiny_llm
from tests.engine.test_sampling import reference_probs
from tests.rounding import U


def choose_tokens(logits: torch.Tensor, sampled: SampledRows | None) -> list[int]:
    """Every kept row's choice, on the host."""
    return choose_on_device(logits, sampled).tolist()


def verify(draft: DraftTree | None, choices: list[int]) -> tuple[list[int], list[int]]:
    """The walk down a tree on the host (`trees.walk`), the oracle `accept` is checked against:
    `choices[0]` after the root, `choices[1 + i]` after draft node i."""
    return walk(draft, lambda node: choices[0 if node is None else 1 + node])


def _rows(rows, temperature, top_k, top_p, uniform) -> SampledRows:
    return SampledRows(
        rows=torch.tensor(rows),
        temperature=torch.tensor(temperature, dtype=torch.float32),
        top_k=torch.tensor(top_k),
        top_p=torch.tensor(top_p, dtype=torch.float32),
        uniform=torch.tensor(uniform, dtype=torch.float64),
    )


def assert_warped_like(got: torch.Tensor, logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> None:
    """One row of a float32 warp against `reference_probs` (the same float32 logits, in float64):
    each removed token exactly 0, each kept one within what float32 rounding can move it. Relative
    to p, to first order: x = logits / t and its max round by u each, the exponent x - max by
    u |x - max| (4u max|x| in all), exp is within 2u: each e^x within r = (4 max|x| + 2) u; a
    normalization of n terms carries its term's r, the sum's r + (n - 1)u and 2u for the reciprocal
    and product, and the top-p renormalization does so again: (16 max|x| + 3n + 11) u."""
    want = reference_probs(logits, temperature, top_k, top_p)
    x_max, n = logits.abs().max().item() / temperature, logits.shape[-1]
    assert torch.equal(got == 0, want == 0)
    assert ((got.double() - want).abs() <= want * (16 * x_max + 3 * n + 11) * U).all()


def test_warp_rows_matches_the_plain_one_row_warp():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    params = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.6), (0.9, 12, 0.8)]
    t, k, p = (list(x) for x in zip(*params))
    got = warp_rows(logits, torch.tensor(t), torch.tensor(k), torch.tensor(p))
    for row, (temperature, top_k, top_p) in enumerate(params):
        assert_warped_like(got[row], logits[row], temperature, top_k, top_p)


def test_greedy_rows_take_the_argmax_and_sampled_rows_invert_the_cdf():
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]]))
    # Row 1 and 2 sample; CDF of row 1 is 0.4, 0.7, 0.9, 1.0.
    choices = choose_tokens(logits, _rows([1, 2], [1.0, 1.0], [0, 0], [1.0, 1.0], [0.65, 0.0]))
    assert choices == [3, 1, 0]
    assert choose_tokens(logits, None) == [3, 0, 0]


@pytest.mark.parametrize("u", [0.0, 0.3, 0.999999999])
def test_a_draw_never_lands_on_a_removed_token(u):
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]]))
    # top-k 2 keeps tokens 0 and 1; any uniform lands on one of them.
    (token,) = choose_tokens(logits, _rows([0], [1.0], [2], [1.0], [u]))
    assert token in (0, 1)
    (token,) = choose_tokens(logits, _rows([0], [1.0], [0], [0.5], [u]))  # top-p 0.5 keeps 0 and 1
    assert token in (0, 1)


@pytest.mark.parametrize("u", [0.0, 0.5, 0.999999999])
def test_a_top_p_that_rounds_to_zero_in_float32_keeps_the_top_token(u):
    """A request may ask any top_p in (0, 1]; one below float32's smallest subnormal is 0 on the
    device, which kept no token at all (NaN probabilities, a draw of -1)."""
    logits = torch.log(torch.tensor([[0.1, 0.6, 0.2, 0.1]]))
    rows = _rows([0], [1.0], [0], [5e-324], [u])
    assert rows.top_p.item() == 0.0
    assert choose_tokens(logits, rows) == [1]
    assert warp_rows(logits, rows.temperature, rows.top_k, rows.top_p).tolist() == [[0.0, 1.0, 0.0, 0.0]]


def test_a_top_k_at_or_above_the_vocabulary_is_no_cut_even_beside_a_row_that_cuts():
    logits = (torch.randn(1, 50, generator=torch.Generator().manual_seed(1)) * 3).expand(4, 50)  # one row, 4 times
    t = torch.ones(4)
    p = torch.ones(4)
    got = warp_rows(logits, t, torch.tensor([0, 50, 500, 3]), p)  # row 3 cuts: the top-k path runs
    assert torch.equal(got[1], got[0]) and torch.equal(got[2], got[0])  # the same row, the same arithmetic
    assert_warped_like(got[3], logits[3], 1.0, 3, 1.0)


def test_seeded_sampling_with_top_k_at_or_above_the_vocabulary_equals_top_k_unset():
    prompt = list(range(3, 40, 3))
    ks = [0, TINY_VOCAB, TINY_VOCAB * 10, MAX_INT32, 5]  # 5: a row that cuts, in the same steps
    params = [SamplingParams(max_new_tokens=24, temperature=1.0, top_k=k, seed=7) for k in ks]
    unset, at_vocab, ten_times, largest, cut = tiny_llm(None, draft="none").generate([prompt] * len(ks), params)
    assert len(set(unset.token_ids)) > 5  # really sampled
    assert at_vocab.token_ids == ten_times.token_ids == largest.token_ids == unset.token_ids
    assert cut.token_ids != unset.token_ids


def test_verify_follows_the_models_choices_down_the_tree():
    tree = DraftTree((5, 6, 7, 8), (None, 0, None, 1))  # root -> 5 -> 6 -> 8, root -> 7
    # Choices by row: root picks 5, node 0 picks 6, node 1 picks 9 (no child): emit 5 6 9.
    assert verify(tree, [5, 6, 9, 0, 0]) == ([5, 6, 9], [0, 1])
    assert verify(tree, [7, 0, 0, 3, 0]) == ([7, 3], [2])
    assert verify(None, [4]) == ([4], [])


def _random_tree(rng: random.Random, n: int) -> DraftTree:
    """n nodes in topological order, siblings with distinct tokens from a small vocabulary."""
    tokens: list[int] = []
    parents: list[int | None] = []
    used: dict[int | None, set[int]] = {}
    while len(tokens) < n:
        parent = rng.choice([None, *range(len(tokens))])
        free = [t for t in range(6) if t not in used.setdefault(parent, set())]
        if not free:
            continue
        token = rng.choice(free)
        used[parent].add(token)
        tokens.append(token)
        parents.append(parent)
    return DraftTree(tuple(tokens), tuple(parents))


def test_acceptance_on_the_device_equals_the_walk_down_each_tree():
    rng = random.Random(0)
    for _ in range(200):
        requests = []  # (root row, tree, window rows)
        row = 0
        for _ in range(rng.randint(1, 6)):
            tree = _random_tree(rng, rng.randint(1, 12)) if rng.random() < 0.8 else None
            window = rng.choice([0, 0, 3])
            requests.append((row, tree, window))
            row += 1 + (len(tree) if tree else 0) + window
        # Choices from the same small vocabulary, so that long paths are accepted often.
        choices = [rng.randrange(6) for _ in range(row)]
        result = accept(torch.tensor(choices), TreeRows.of(requests)).tolist()
        s = len(requests)
        windows = result[2 * s :]
        w = 0
        for j, (root, tree, window) in enumerate(requests):
            verified = 1 + (len(tree) if tree else 0)
            tokens, nodes = verify(tree, choices[root : root + verified])
            assert accepted_path(tree, root, result[j]) == nodes
            path_tokens = [tree.tokens[i] for i in nodes] if tree else []
            assert [*path_tokens, result[s + j]] == tokens
            assert windows[w : w + window] == choices[root + verified : root + verified + window]
            w += window


def test_warping_with_the_hosts_cut_sizes_equals_reading_them_from_the_device():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 300, generator=gen)
    temperature = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5])
    top_k = torch.tensor([0, 5, 300, 40, 1000])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.5, 1.0])
    read = warp_rows(logits, temperature, top_k, top_p)
    told = warp_rows(logits, temperature, top_k, top_p, max_top_k=40, any_top_p=True)
    assert torch.equal(read, told)
    # No row cuts by top-p: the host says so and the sort is skipped, with the same result.
    ones = torch.ones(5)
    assert torch.equal(
        warp_rows(logits, temperature, top_k, ones), warp_rows(logits, temperature, top_k, ones, 40, False)
    )


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_a_sampled_rows_warp_and_draw_keep_their_bits_alone_and_among_others(threads):
    """SmolLM2's 49,152-token vocabulary: one row warped and drawn alone, and the same row among 7
    others with other parameters, gives the same probabilities and token, bit for bit, at any
    thread count (its sums and softmax are the row's own)."""
    vocab, rows = 49152, 8
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.5, 0.9, 1.1, 0.8, 1.0])
    top_k = torch.tensor([0, 50, 0, 1000, 0, 7, 0, 0])
    top_p = torch.tensor([0.9, 1.0, 0.95, 1.0, 0.5, 1.0, 1.0, 0.99])
    uniform = torch.rand(rows, generator=gen, dtype=torch.float64)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        together = warp_rows(logits, temperature, top_k, top_p)
        chosen = choose_tokens(logits, SampledRows(torch.arange(rows), temperature, top_k, top_p, uniform))
        for i in range(rows):
            one = slice(i, i + 1)
            alone = warp_rows(logits[one], temperature[one], top_k[one], top_p[one])
            assert torch.equal(alone, together[one]), i
            rows_i = SampledRows(torch.tensor([0]), temperature[one], top_k[one], top_p[one], uniform[one])
            assert choose_tokens(logits[one], rows_i) == [chosen[i]], i
    finally:
        torch.set_num_threads(before)
