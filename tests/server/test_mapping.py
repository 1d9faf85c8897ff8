"""One mapping of the lookahead options and the stop-id bound: gRPC and the OpenAI API give the
engine the same fields for the same options, and refuse the same counts."""

from __future__ import annotations

import pytest

from batchserve.config import LimitsConfig
from batchserve.server.grpc.convert import sampling_params
from batchserve.server.openai.bodies import CompletionRequest
from batchserve.v1 import generation_pb2 as pb

OPTIONS = [
    {},
    {"enable": False, "decoding_length": 9},
    {"enable": True, "decoding_length": 9, "layout": "parallel"},
    {"jacobi_window": 3},
    {"jacobi_ngram": 4, "jacobi_guesses": 2, "decoding_length": 0},
]


@pytest.mark.parametrize("options", OPTIONS)
def test_grpc_and_openai_map_the_lookahead_options_alike(options: dict) -> None:
    grpc_params = sampling_params(pb.GenerateRequest(lookahead=pb.LookaheadOptions(**options)))
    body = CompletionRequest(model="m", prompt="x", max_tokens=4, lookahead=options or None)
    http_params = body.sampling_params(4, 64, LimitsConfig())
    fields = ("decoding_length", "draft_layout", "jacobi")
    assert [getattr(grpc_params, f) for f in fields] == [getattr(http_params, f) for f in fields]


def test_grpc_and_openai_refuse_the_same_stop_id_count() -> None:
    limits = LimitsConfig(max_stop_token_ids=2)
    with pytest.raises(ValueError, match=r"sampling\.stop_token_ids: 3 ids, at most 2"):
        sampling_params(pb.GenerateRequest(sampling=pb.SamplingOptions(stop_token_ids=[1, 2, 3])), limits)
    body = CompletionRequest(model="m", prompt="x", max_tokens=4, stop_token_ids=[1, 2, 3])
    with pytest.raises(ValueError, match=r"^stop_token_ids: 3 ids, at most 2"):
        body.sampling_params(4, 64, limits)
