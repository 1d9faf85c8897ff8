"""SamplingParams: every numeric field has a documented range, checked where it enters."""

from __future__ import annotations

import pytest

from batchserve.request import MAX_INT32, SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"seed": 2**64}, "seed"),  # torch.Generator.manual_seed overflows on it in the runner
        ({"seed": -(2**63) - 1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"top_k": 2**63}, "top_k"),  # torch.tensor overflows on it in the runner
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": MAX_INT32 + 1}, "max_new_tokens"),
        ({"max_new_tokens": True}, "max_new_tokens"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 101.0}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"decoding_length": 2**40}, "decoding_length"),
        ({"jacobi": (2**40, None, None)}, "jacobi"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ],
)
def test_out_of_range_numbers_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_the_range_edges_are_accepted_and_a_negative_seed_is_its_torch_equivalent():
    p = SamplingParams(seed=2**64 - 1, top_k=MAX_INT32, max_new_tokens=MAX_INT32, temperature=100.0, top_p=1)
    assert p.seed == 2**64 - 1
    # torch maps a negative seed s to s + 2**64: the same seed, the same stream.
    assert SamplingParams(seed=-1).seed == 2**64 - 1 and SamplingParams(seed=-(2**63)).seed == 2**63
    assert SamplingParams(seed=0).seed == 0


def test_stop_token_ids_are_looked_up_in_a_set():
    p = SamplingParams(stop_token_ids=[5, 9, 5])
    assert p.stop_token_ids == (5, 9, 5) and p.stop_token_set == frozenset({5, 9})
    assert SamplingParams(stop_token_ids=[1]) == SamplingParams(stop_token_ids=(1,))
