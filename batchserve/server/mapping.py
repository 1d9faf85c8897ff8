"""One mapping from the front ends' request options to the engine's `SamplingParams` fields,
shared by gRPC and every OpenAI endpoint: batchserve's lookahead options, and the count bounds a
list is checked against before it is copied."""

from __future__ import annotations

from typing import Any

from batchserve.config import LimitsConfig


def lookahead_fields(
    enable: bool | None,
    decoding_length: int | None,
    layout: str | None,
    jacobi: tuple[int | None, int | None, int | None],
) -> dict[str, Any]:
    """`SamplingParams` fields for the lookahead options (each None where the request left it
    out): `enable` False is a draft length of 0; a Jacobi shape where any of (window, n-gram,
    guesses) is given."""
    fields: dict[str, Any] = {}
    if enable is False:
        fields["decoding_length"] = 0
    elif decoding_length is not None:
        fields["decoding_length"] = decoding_length
    if layout is not None:
        fields["draft_layout"] = layout
    if any(v is not None for v in jacobi):
        fields["jacobi"] = tuple(jacobi)
    return fields


def check_stop_token_count(count: int, limits: LimitsConfig, field: str = "stop_token_ids") -> None:
    """Raise ValueError naming `field` where a request's stop token ids are more than the limit
    (each is looked up for every emitted token; checked before the list is copied)."""
    if count > limits.max_stop_token_ids:
        raise ValueError(f"{field}: {count} ids, at most {limits.max_stop_token_ids}")
