"""The bench's engines: one forward per loaded model and kernel set, shared by a sweep's runs."""

from __future__ import annotations

from typing import Any

import pytest

from batchserve.bench.methods import batchserve_method
from batchserve.bench.runs import forward_for, run_batchserve
from tests.conftest import make_ascii_model


def test_a_sweeps_engines_share_one_forward_per_kernel_set(tiny_tokenizer: Any) -> None:
    from batchserve.model import NativeLlamaForCausalLM

    model = make_ascii_model()
    none, lookahead, blas, hf = (batchserve_method(n) for n in ("none", "lookahead", "none-blas", "none-hf"))
    assert none is not None and lookahead is not None and blas is not None and hf is not None
    native = forward_for(model, none)
    assert isinstance(native, NativeLlamaForCausalLM)
    assert forward_for(model, lookahead) is native  # same kernels: built once
    assert forward_for(model, blas) is not native  # torch's BLAS is another forward
    assert forward_for(model, hf) is model  # the transformers forward is the model as loaded
    assert forward_for(make_ascii_model(), none) is not native  # another model, its own forward
    # Engines of every method run on it, lossless against each other (the bench checks the rest).
    prompts = [[5 + (i * 7 + j) % 60 for j in range(10)] for i in range(3)]
    plain = run_batchserve(model, tiny_tokenizer, prompts, 12, 3, none, [], 8)
    drafted = run_batchserve(model, tiny_tokenizer, prompts, 12, 3, lookahead, [], 8)
    assert drafted.outputs == plain.outputs and all(len(o) == 12 for o in plain.outputs)
    # The run measured the loop that serves: on a CPU its outputs are built after the forward.
    for run in (plain, drafted):
        assert run.phases.served is not None
        served = run.phases.served.summary()
        assert served is not None and served["loop"] == "in series" and served["steps"] >= 1
        assert served["host_ms"] > 0 and served["device_ms"] > 0 and served["tokens"] >= 1


def test_seated_throughput_leaves_out_the_steps_with_a_seat_empty() -> None:
    from batchserve import SamplingParams
    from batchserve.bench.methods import Row
    from batchserve.bench.runs import PhaseTotals
    from batchserve.records import ScheduledRequest, SchedulerOutput, StepPhases

    def step(requests: int, tokens: int, wall: float) -> tuple[SchedulerOutput, StepPhases]:
        reqs = tuple(
            ScheduledRequest(f"r{i}", (1,), 9, (0, 1, 2), None, True, SamplingParams()) for i in range(requests)
        )
        return SchedulerOutput(requests=reqs, finished_request_ids=()), StepPhases(wall=wall, tokens=tokens)

    totals = PhaseTotals(batch_size=4)
    for requests, tokens, wall in ((4, 6, 0.1), (4, 4, 0.1), (1, 1, 0.05), (0, 0, 0.01)):  # then a lone tail
        totals.add(*step(requests, tokens, wall))
    row = Row("lookahead", "humaneval", 4, 4, 11, 1.0, 11 / 0.25, 1.0, 0.1, 0.1, 0.01, 0.01, True)
    totals.apply(row)
    assert totals.steps == 3 and row.seated_tokens_per_s == 50.0  # 10 tokens in 0.2 s; the tail left out


def test_logprobs_methods_ask_for_top_logprobs_and_emit_the_same_tokens(
    tiny_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import batchserve.bench.runs as runs
    from batchserve.bench.methods import LOGPROBS, known_method, method_rank, none_of

    m = batchserve_method("lookahead-adaptive-gguf+logprobs")
    assert m is not None and m.logprobs == LOGPROBS and m.cpu_weights == "gguf" and m.adaptive
    assert batchserve_method("lookahead-adaptive-gguf").logprobs is None  # type: ignore[union-attr]
    for name in ("none+logprobs+nocache+prediction", "none+prediction+logprobs+nocache", "none+nocache+logprobs"):
        both = batchserve_method(name)
        assert both is not None and both.logprobs == LOGPROBS and not both.prefix_caching
        assert both.predicted == ("prediction" in name)
    assert known_method("jacobi-4-3+logprobs") and not known_method("hf+logprobs")
    assert method_rank("lookahead") < method_rank("lookahead+logprobs") < method_rank("lookahead-4")
    assert none_of("lookahead-adaptive-gguf+logprobs") == "none-gguf"
    # Each request asks for them; the tokens are those without (the lossless check still holds).
    model = make_ascii_model()
    prompts = [[5 + (i * 7 + j) % 60 for j in range(10)] for i in range(3)]
    asked: list[int | None] = []
    lookahead, with_logprobs = batchserve_method("lookahead"), batchserve_method("lookahead+logprobs")
    assert lookahead is not None and with_logprobs is not None
    plain = run_batchserve(model, tiny_tokenizer, prompts, 12, 3, lookahead, [], 8)
    real = runs.method_engine

    def listening(*args: Any) -> Any:
        llm = real(*args)
        llm.engine.step_listeners.append(lambda out, _: asked.extend(r.params.logprobs for r in out.requests))
        return llm

    monkeypatch.setattr(runs, "method_engine", listening)
    told = run_batchserve(model, tiny_tokenizer, prompts, 12, 3, with_logprobs, [], 8)
    assert told.outputs == plain.outputs and asked and set(asked) == {LOGPROBS}


def test_a_plain_method_name_runs_the_weights_make_serve_runs():
    from batchserve.bench.methods import as_served, none_of

    methods = ["hf", "none", "lookahead-adaptive+nocache", "none-f32", "none-bf16", "none-blas", "none-hf", "llma"]
    assert as_served(methods, "gguf") == [
        "hf", "none-gguf", "lookahead-adaptive-gguf+nocache", "none-f32", "none-bf16", "none-blas", "none-hf",
        "llma-gguf",
    ]  # fmt: skip
    assert as_served(methods, "float32") == methods
    # Any method on our forward takes a weights suffix, and says which plain decoding it is checked with.
    blocks = batchserve_method("llma-gguf")
    assert blocks is not None and blocks.cpu_weights == "gguf" and blocks.draft == "llma"
    assert batchserve_method("none-f32").cpu_weights == "float32"  # type: ignore[union-attr]
    assert batchserve_method("none-hf-gguf") is None  # the transformers forward runs its own float32
    assert none_of("llma-gguf") == "none-gguf" and none_of("lookahead-adaptive-f32+nocache") == "none-f32"


@pytest.mark.parametrize("beside", [False, True])
def test_the_loop_table_counts_full_steps_and_the_outputs_where_they_are_in_series(beside: bool) -> None:
    from batchserve import SamplingParams
    from batchserve.bench.methods import Row
    from batchserve.bench.served_loop import ServedSteps, loop_table
    from batchserve.records import ScheduledRequest, SchedulerOutput, StepPhases

    served = ServedSteps(batch_size=2, beside_forward=beside)
    for requests, tokens in ((2, 4), (2, 6), (1, 1)):  # the last step has a seat empty
        reqs = tuple(ScheduledRequest(f"r{i}", (1,), 9, (0,), None, True, SamplingParams()) for i in range(requests))
        phases = StepPhases(schedule=1e-3, prepare=1e-3, forward=5e-3, verify=1e-3, commit=1e-3, outputs=2e-3)
        phases.tokens = tokens
        served.add(SchedulerOutput(requests=reqs, finished_request_ids=()), phases)
    summary = served.summary()
    assert summary is not None and summary["steps"] == 2 and summary["tokens"] == 2.5  # 10 tokens, 2 requests, 2 steps
    assert summary["host_ms"] == (4.0 if beside else 6.0) and summary["device_ms"] == 5.0
    row = Row("lookahead", "humaneval", 2, 4, 11, 1.0, 11.0, 1.0, 0.1, 0.1, 0.01, 0.01, True)
    row.served_step = summary
    table = "\n".join(loop_table([row]))
    assert ("| pipelined |" if beside else "| in series |") in table and "| 5.00 |" in table
