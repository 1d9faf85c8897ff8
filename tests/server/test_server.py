"""A real server on a loopback port and a real gRPC client."""

from __future__ import annotations

import asyncio
import collections
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from batchserve import SamplingParams
from batchserve.admission import client_id
from batchserve.attention import INVARIANT_BACKENDS
from batchserve.cli import main as cli_main
from batchserve.llm import LLM
from batchserve.server.app import SERVICE_NAME
from batchserve.server.client import build_request
from batchserve.v1 import generation_pb2 as pb
from tests.server.conftest import start_server, tiny_core


def _offline(prompts, params):
    return LLM.from_core(tiny_core()).generate(prompts, params)


async def _stream(stub, req):
    chunks = [c async for c in stub.StreamGenerate(req)]
    return chunks


class _StepLog:
    """Per request, from the scheduler's own step plans (not from the requests' stats): the steps
    that sampled it (each emits tokens), and the draft tokens those steps verified; by the id its
    client chose (the engine's is namespaced per tenant)."""

    def __init__(self, core) -> None:
        self.steps: collections.Counter[str] = collections.Counter()
        self.drafted: collections.Counter[str] = collections.Counter()
        core.step_listeners.append(self)

    def __call__(self, out, phases) -> None:
        for item in out.requests:
            if item.sample:
                rid = client_id(item.request_id)
                self.steps[rid] += 1
                self.drafted[rid] += len(item.draft) if item.draft is not None else 0


def _sample(server, name: str, **labels: str) -> float | None:
    """A metric's value in the server's registry (None if it has no such sample yet)."""
    return server.metrics.registry.get_sample_value(name, labels)


async def test_unary_and_stream_match_offline_generate(running):
    stub = running.stub
    log = _StepLog(running.core)
    inputs = ["héllo wörld, 漢字", [5, 6, 7, 8], [{"role": "user", "content": "ünïcode?"}]]
    offline_prompts = [running.core.text.tokenize(inputs[0]), inputs[1], running.core.text.render_chat(inputs[2])]
    params = SamplingParams(max_new_tokens=40, temperature=0.9, seed=7)
    expected = _offline(offline_prompts, params)
    for i, (prompt, exp) in enumerate(zip(inputs, expected, strict=True)):
        unary = await stub.Generate(
            build_request(prompt, request_id=f"u{i}", max_new_tokens=40, temperature=0.9, seed=7)
        )
        chunks = await _stream(
            stub, build_request(prompt, request_id=f"s{i}", max_new_tokens=40, temperature=0.9, seed=7)
        )
        assert list(unary.token_ids) == exp.token_ids
        assert [t for c in chunks for t in c.token_ids] == exp.token_ids
        assert "".join(c.text for c in chunks) == unary.text == exp.text
        assert unary.finish_reason == pb.FINISH_REASON_LENGTH
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
        assert unary.usage.prompt_tokens == len(exp.prompt_token_ids) and unary.usage.completion_tokens == 40
        assert chunks[-1].usage.completion_tokens == 40
        # Step counts depend on the (shared, learning) trie: they are checked against the steps
        # the scheduler planned, and for the stream against the chunks (one per step with tokens).
        steps = log.steps[f"u{i}"]
        assert unary.stats.steps == steps and unary.stats.draft_tokens_proposed == log.drafted[f"u{i}"]
        assert unary.stats.draft_tokens_accepted == 40 - steps
        assert unary.stats.tokens_per_step == pytest.approx(40 / steps)
        stream_steps = sum(1 for c in chunks if c.token_ids)
        assert chunks[-1].stats.steps == stream_steps == log.steps[f"s{i}"]
        assert chunks[-1].stats.draft_tokens_proposed == log.drafted[f"s{i}"]
        assert chunks[-1].stats.draft_tokens_accepted == 40 - stream_steps
        assert chunks[-1].stats.tokens_per_step == pytest.approx(40 / stream_steps)
    assert any(ord(ch) > 127 for ch in unary.text)  # the byte-level model emits non-ASCII text


async def test_without_drafts_every_step_emits_one_token(running):
    """Drafting off for the request: 40 tokens are exactly 40 steps, 1.0 tokens per step, and the
    step metrics count exactly those steps (known without running the engine)."""
    req = build_request([5, 6, 7, 8], max_new_tokens=40, ignore_eos=True, lookahead=False)
    unary = await running.stub.Generate(req)
    chunks = await _stream(running.stub, req)
    assert list(unary.token_ids) == [t for c in chunks for t in c.token_ids]
    assert [len(c.token_ids) for c in chunks] == [1] * 40  # one chunk per step, one token each
    for stats in (unary.stats, chunks[-1].stats):
        assert (stats.steps, stats.draft_tokens_proposed, stats.draft_tokens_accepted) == (40, 0, 0)
        assert stats.tokens_per_step == 1.0
    port = running.server.metrics_port
    assert _metric(port, "batchserve_engine_steps") == 80  # the two requests ran one after the other
    assert _metric(port, "batchserve_step_tokens_count") == 80
    assert _metric(port, "batchserve_step_tokens_sum") == 2 * (4 + 39)  # the prompt, then one token a step
    assert _metric(port, 'batchserve_draft_decoding_length_bucket{le="0.0"}') == 80
    assert _metric(port, "batchserve_draft_decoding_length_count") == 80
    assert _metric(port, "batchserve_request_steps_total") == 80
    assert _metric(port, "batchserve_draft_tokens_proposed_total") == 0
    assert _metric(port, "batchserve_mean_accepted_tokens_per_step") == 0.0
    assert _metric(port, "batchserve_request_tokens_per_step_sum") == 2.0
    assert _metric(port, "batchserve_request_tokens_per_step_count") == 2
    assert _metric(port, "batchserve_generation_tokens_total") == 80
    assert _metric(port, 'batchserve_requests_finished_total{finish_reason="length"}') == 2


async def test_preemptions_are_counted_once_each(monkeypatch):
    # 8 blocks of 4 slots: each request needs 8 by its end, so two running at once must preempt.
    r = await start_server(tiny_core(max_num_seqs=2, num_blocks=8), metrics_port=0)
    fresh_starts: collections.Counter[str] = collections.Counter()  # steps that plan a request from no K/V

    def count(out, phases) -> None:
        for item in out.requests:
            fresh_starts[client_id(item.request_id)] += item.num_computed_tokens == 0

    r.core.step_listeners.append(count)
    real = r.core.runner.launch

    def slow(out):  # the first request is still running when the second arrives
        time.sleep(0.02)
        return real(out)

    monkeypatch.setattr(r.core.runner, "launch", slow)
    try:
        first = r.stub.StreamGenerate(
            build_request([1, 2, 3], request_id="a", max_new_tokens=28, ignore_eos=True, lookahead=False)
        )
        await first.read()
        second = await r.stub.Generate(
            build_request([4, 5, 6], request_id="b", max_new_tokens=28, ignore_eos=True, lookahead=False)
        )
        rest = []
        while (chunk := await first.read()) is not grpc.aio.EOF:
            rest.append(chunk)
        assert second.usage.completion_tokens == rest[-1].usage.completion_tokens == 28
        # Each preemption drops a request's K/V; it is then planned from scratch once more. Exactly
        # once here: "b" (the younger) gives way when "a" needs a block, and cannot come back before
        # "a" ends, which then never needs to give way (it is the oldest).
        preempted = sum(n - 1 for n in fresh_starts.values())
        assert preempted == 1 and fresh_starts == {"a": 1, "b": 2}
        assert r.server.engine.load().num_preemptions == 1
        assert _metric(r.server.metrics_port, "batchserve_num_preemptions_total") == 1
    finally:
        await r.channel.close()
        await r.server.shutdown()


async def test_32_concurrent_streams(running):
    prompts = [[i + 1, (7 * i) % 200 + 3, 9] for i in range(32)]
    expected = _offline(prompts, SamplingParams(max_new_tokens=24))
    outs = await asyncio.gather(*(_stream(running.stub, build_request(p, max_new_tokens=24)) for p in prompts))
    for chunks, exp in zip(outs, expected, strict=True):
        assert [t for c in chunks for t in c.token_ids] == exp.token_ids
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH and chunks[-1].usage.completion_tokens == 24
    assert _sample(running.server, "batchserve_requests_finished_total", finish_reason="length") == 32
    assert _sample(running.server, "batchserve_generation_tokens_total") == 32 * 24
    assert _sample(running.server, "batchserve_prompt_tokens_total") == 32 * 3


@pytest.mark.parametrize(
    ("request_kwargs", "field"),
    [
        ({}, "input"),
        ({"text": ""}, "input.text"),
        ({"token_ids": []}, "input"),
        ({"token_ids": [1, 256]}, "input.token_ids"),
        ({"token_ids": [1, -5]}, "input.token_ids"),
        ({"token_ids": [1] * 1024}, "context"),
        ({"chat": []}, "input"),
        ({"chat": [{"role": "robot", "content": "hi"}]}, "role"),
        ({"token_ids": [1], "max_new_tokens": 0}, "max_new_tokens"),
        ({"token_ids": [1], "temperature": -1.0}, "temperature"),
        ({"token_ids": [1], "top_p": 1.5}, "top_p"),
        ({"token_ids": [1], "top_k": -2}, "top_k"),
        ({"token_ids": [1], "stop_token_ids": [999]}, "stop_token_ids"),
        ({"token_ids": [1], "layout": "zigzag"}, "draft_layout"),
        ({"token_ids": [1], "decoding_length": -1}, "decoding_length"),
        ({"token_ids": [1], "decoding_length": 9}, "decoding_length"),  # above the server's cap of 8
        ({"token_ids": [1], "jacobi": (0, None, None)}, "jacobi"),
        ({"token_ids": [1], "jacobi": (None, 1, None)}, "jacobi"),
        ({"token_ids": [1], "stop": ["x"] * 17}, "stop"),
        ({"token_ids": [1], "stop": ["x" * 257]}, "stop[0]"),
        ({"token_ids": [1], "request_id": "forged\nINFO request admin finished"}, "request_id"),
        ({"token_ids": [1], "request_id": "x" * 129}, "request_id"),
        ({"text": "a" * 40_000}, "input.text"),  # cannot fit 1024 tokens, refused untokenized
    ],
)
async def test_invalid_input_is_invalid_argument_naming_the_field(running, request_kwargs, field):
    kw = dict(request_kwargs)
    req = pb.GenerateRequest(request_id=kw.pop("request_id", ""))
    if "text" in kw:
        req.text = kw.pop("text")
    elif "token_ids" in kw:
        req.token_ids.ids.extend(kw.pop("token_ids"))
        req.token_ids.SetInParent()
    elif "chat" in kw:
        req.chat.SetInParent()
        req.chat.messages.extend(pb.ChatMessage(**m) for m in kw.pop("chat"))
    template = build_request([1], **kw)
    req.sampling.CopyFrom(template.sampling)
    req.lookahead.CopyFrom(template.lookahead)
    for call in (running.stub.Generate, running.stub.StreamGenerate):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            result = call(req)
            if hasattr(result, "__aiter__"):
                async for _ in result:
                    pass
            else:
                await result
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in e.value.details()
    assert _sample(running.server, "batchserve_requests_rejected_total", code="INVALID_ARGUMENT") == 2  # one per call
    # Still serving.
    ok = await running.stub.Generate(build_request([1, 2], max_new_tokens=3))
    assert ok.usage.completion_tokens == 3


async def test_malformed_utf8_stop_string(running):
    req = build_request([1, 2], max_new_tokens=3)
    req.sampling.stop.append(b"\xff\xfe")
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await running.stub.Generate(req)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.stop[0]" in e.value.details()


async def test_full_waiting_queue_is_resource_exhausted():
    r = await start_server(tiny_core(max_num_seqs=1), max_waiting_requests=1)
    try:
        long = build_request([1, 2, 3], max_new_tokens=400, ignore_eos=True)
        first = r.stub.StreamGenerate(long)
        await first.read()  # running
        second = r.stub.StreamGenerate(long)
        while r.core.scheduler.num_waiting < 1:
            await asyncio.sleep(0.01)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await r.stub.Generate(long)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert _sample(r.server, "batchserve_requests_rejected_total", code="RESOURCE_EXHAUSTED") == 1
        first.cancel()
        second.cancel()
        ok = await r.stub.Generate(build_request([4], max_new_tokens=2))
        assert ok.usage.completion_tokens == 2
    finally:
        await r.channel.close()
        await r.server.shutdown()


async def _wait_pool_full(core, timeout: float = 5.0) -> None:
    alloc = core.scheduler.allocator
    for _ in range(int(timeout / 0.01)):
        if alloc.num_free_blocks == alloc.num_blocks and not core.scheduler.requests:
            core.scheduler.check_integrity()
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"blocks not freed: {alloc.num_free_blocks}/{alloc.num_blocks}")


def _metric(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exposed")


async def test_cancel_and_deadline_free_blocks(running):
    port = running.server.metrics_port
    call = running.stub.StreamGenerate(build_request([1, 2, 3], max_new_tokens=1000, ignore_eos=True))
    await call.read()
    await call.read()
    # How many blocks it holds by now depends on how far it got: only that it holds some.
    assert _metric(port, "batchserve_kv_cache_free_blocks") < running.core.scheduler.allocator.num_blocks
    call.cancel()
    await _wait_pool_full(running.core)
    assert _metric(port, "batchserve_kv_cache_free_blocks") == running.core.scheduler.allocator.num_blocks

    with pytest.raises(grpc.aio.AioRpcError) as e:
        await running.stub.Generate(build_request([1, 2, 3], max_new_tokens=1000, ignore_eos=True), timeout=0.3)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await _wait_pool_full(running.core)
    # Both: the stream the client cancelled, and the call whose deadline passed.
    assert _metric(port, 'batchserve_requests_finished_total{finish_reason="cancelled"}') == 2


async def test_health_reflection_metrics_tokenize_and_model_info(running):
    health = health_pb2_grpc.HealthStub(running.channel)
    for service in ("", SERVICE_NAME):
        resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING

    refl = reflection_pb2_grpc.ServerReflectionStub(running.channel)
    responses = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = [s.name async for r in responses for s in r.list_services_response.service]
    assert SERVICE_NAME == "batchserve.v1.TextGeneration" and SERVICE_NAME in names and "grpc.health.v1.Health" in names

    reply = await running.stub.Generate(build_request([1, 2, 3], max_new_tokens=5))
    port = running.server.metrics_port
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for name in (
        "batchserve_num_requests_running",
        "batchserve_num_requests_waiting",
        "batchserve_kv_cache_usage_ratio",
        "batchserve_time_to_first_token_seconds_bucket",
        "batchserve_inter_token_latency_seconds_bucket",
        "batchserve_e2e_request_latency_seconds_bucket",
        "batchserve_request_queue_time_seconds_bucket",
        "batchserve_prompt_tokens_total",
        "batchserve_generation_tokens_total",
        "batchserve_draft_tokens_proposed_total",
        "batchserve_draft_tokens_accepted_total",
        "batchserve_mean_accepted_tokens_per_step",
        "batchserve_requests_finished_total",
        "batchserve_draft_decoding_length_bucket",
        "batchserve_step_tokens_bucket",
        "batchserve_num_preemptions_total",
        "batchserve_step_phase_seconds_bucket",
    ):
        assert name in body, name
    # The only request: every engine step sampled it once (its prompt fits one step).
    assert _metric(port, "batchserve_step_tokens_count") == reply.stats.steps
    assert _metric(port, "batchserve_draft_decoding_length_count") == reply.stats.steps
    assert _metric(port, "batchserve_draft_tokens_proposed_total") == reply.stats.draft_tokens_proposed
    assert _metric(port, "batchserve_generation_tokens_total") == 5
    assert _metric(port, "batchserve_prompt_tokens_total") == 3
    assert _metric(port, 'batchserve_requests_finished_total{finish_reason="length"}') == 1

    tok = await running.stub.Tokenize(pb.TokenizeRequest(text="hi"))
    assert list(tok.token_ids) == [104, 105]
    info = await running.stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.vocab_size == 256 and info.max_model_len == 1024 and info.draft_method == "lookahead"
    # The start-up check's verdict on this model (the invariant attention where this CPU passes).
    core = running.server.engine.core
    assert info.batch_invariant == core.facts.batch_invariant
    assert core.facts.batch_invariant <= (
        core.facts.attention_backend in INVARIANT_BACKENDS
    )  # only an invariant attention claims
    assert info.batch_invariant_why == core.facts.invariance_why
    assert ("bit for bit" in info.batch_invariant_why) == info.batch_invariant
    # What runs a step, and why its weights are in that format (a model handed in keeps float32).
    assert info.forward == core.facts.forward.name and info.forward.startswith("native float32 weights")
    assert info.weights_reason == core.facts.forward.weights.why and "handed in" in info.weights_reason
    # The whole record, part by part, with its reasons.
    parts = {p.part: (p.choice, p.why) for p in info.forward_parts}
    assert list(parts) == ["impl", "weights", "linear", "attention", "graphs", "fused"]
    assert (
        parts["attention"] == (core.facts.attention_backend, core.facts.forward.attention.why)
        and parts["graphs"][0] == "off"
    )
    assert all(why for _, why in parts.values())


async def test_shutdown_not_serving_then_in_flight_completes():
    r = await start_server(drain_seconds=0.5, grace_seconds=30, metrics_port=0)
    health = health_pb2_grpc.HealthStub(r.channel)
    probe = f"http://127.0.0.1:{r.server.metrics_port}/health"  # plaintext probes beside a TLS API
    assert urllib.request.urlopen(probe, timeout=5).read() == b'{"status":"ok"}'
    call = r.stub.StreamGenerate(build_request([1, 2, 3], max_new_tokens=60, ignore_eos=True))
    await call.read()
    shutdown = asyncio.create_task(r.server.shutdown())
    await asyncio.sleep(0.1)
    resp = await health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
    with pytest.raises(urllib.error.HTTPError) as refused:
        await asyncio.to_thread(urllib.request.urlopen, probe, timeout=5)
    assert refused.value.code == 503
    # Within the drain window calls are still served (load balancers are routing away) ...
    assert (await r.stub.Generate(build_request([1], max_new_tokens=2))).usage.completion_tokens == 2
    await asyncio.sleep(0.6)
    # ... after it they are refused.
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await r.stub.Generate(build_request([1], max_new_tokens=2))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    rest = []
    while (chunk := await call.read()) is not grpc.aio.EOF:
        rest.append(chunk)
    assert rest[-1].finish_reason == pb.FINISH_REASON_LENGTH and rest[-1].usage.completion_tokens == 60
    await shutdown
    await r.channel.close()


async def test_cli_generate_json(running):
    import json

    port = running.server.port
    out = await asyncio.to_thread(
        _capture, ["generate", "--target", f"127.0.0.1:{port}", "--json", "--max-new-tokens", "6", "hello"]
    )
    obj = json.loads(out)
    assert obj["finish_reason"] == "length" and len(obj["token_ids"]) == 6
    assert obj["usage"] == {"prompt_tokens": 5, "completion_tokens": 6}
    assert set(obj["stats"]) == {"steps", "draft_tokens_proposed", "draft_tokens_accepted", "tokens_per_step"}


def _capture(argv):
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli_main(argv) == 0
    return buf.getvalue()


def test_generated_code_is_fresh(tmp_path):
    """batchserve/v1 is committed; it must be what the .proto generates today."""
    from pathlib import Path

    from grpc_tools import protoc

    root = Path(__file__).resolve().parents[2]
    proto = root / "protos" / "batchserve" / "v1" / "generation.proto"
    rc = protoc.main(
        [
            "protoc",
            f"-I{root / 'protos'}",
            f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(proto),
        ]
    )
    assert rc == 0
    for name in ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py"):
        assert (tmp_path / "batchserve" / "v1" / name).read_text() == (root / "batchserve" / "v1" / name).read_text(), (
            f"{name} is stale: run `make proto`"
        )


async def test_engine_failure_is_internal_and_server_keeps_serving(running, monkeypatch):
    runner = running.core.runner
    real = runner.launch
    state = {"fail": True}

    def flaky(out):
        if state.pop("fail", False):
            raise RuntimeError("injected")
        return real(out)

    monkeypatch.setattr(runner, "launch", flaky)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await running.stub.Generate(build_request([1, 2], max_new_tokens=4))
    assert e.value.code() == grpc.StatusCode.INTERNAL and "injected" in e.value.details()
    ok = await running.stub.Generate(build_request([1, 2], max_new_tokens=4))
    assert ok.finish_reason == pb.FINISH_REASON_LENGTH
    await _wait_pool_full(running.core)


async def test_request_id_in_use_is_invalid_argument(running):
    call = running.stub.StreamGenerate(build_request([1, 2], request_id="same", max_new_tokens=500, ignore_eos=True))
    first = await call.read()
    assert first.request_id == "same"
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await running.stub.Generate(build_request([1, 2], request_id="same", max_new_tokens=2))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
    call.cancel()
    await _wait_pool_full(running.core)


async def test_adaptive_server_reports_its_critical_decoding_length_and_chosen_lengths():
    from batchserve.config import CacheConfig, DraftConfig, EngineConfig, SchedulerConfig
    from batchserve.cost_profile import CostProfile
    from batchserve.engine import EngineCore
    from tests.conftest import make_tiny_model, make_tiny_tokenizer
    from tests.server.conftest import start_server

    counts = (1, 8, 24, 64, 256)
    profile = CostProfile("synthetic", counts, (0,), (tuple(5.0 + max(0, n - 24) for n in counts),))
    config = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128),
        draft=DraftConfig(decoding_length=32, adaptive=True),
    )
    core = EngineCore(config, make_tiny_model(), make_tiny_tokenizer(), cost_profile=profile)
    running = await start_server(core, metrics_port=0)
    try:
        reply = await running.stub.Generate(build_request([1, 2, 3], max_new_tokens=20, ignore_eos=True))
        port = running.server.metrics_port
        assert _metric(port, "batchserve_critical_decoding_length") == 24
        steps = _metric(port, "batchserve_step_tokens_count")
        # The only request: every engine step sampled it once.
        assert steps == reply.stats.steps and _metric(port, "batchserve_draft_decoding_length_count") == steps
        assert _metric(port, "batchserve_generation_tokens_total") == 20
        assert _metric(port, 'batchserve_step_tokens_bucket{le="128.0"}') == steps  # never over the budget
        for phase in ("schedule", "prepare", "forward", "verify", "commit"):  # every step times each phase
            assert _metric(port, f'batchserve_step_phase_seconds_count{{phase="{phase}"}}') == steps, phase
        assert _metric(port, 'batchserve_step_phase_seconds_sum{phase="forward"}') > 0  # a time: only > 0
    finally:
        await running.channel.close()
        await running.server.shutdown()


async def test_prefix_cache_reuse_shows_in_usage_metrics_and_model_info(running):
    port = running.server.metrics_port
    prompt = list(range(10, 31))  # 21 tokens: five full 4-slot blocks, then the token computed anyway
    request = build_request(prompt, max_new_tokens=3, ignore_eos=True)
    first = await running.stub.Generate(request)
    second = await running.stub.Generate(request)
    assert first.usage.cached_prompt_tokens == 0 and second.usage.cached_prompt_tokens == 20
    assert list(first.token_ids) == list(second.token_ids)
    assert _metric(port, "batchserve_prompt_tokens_cached_total") == 20
    assert _metric(port, "batchserve_prefix_cache_queries_total") == 2 * 21
    assert _metric(port, "batchserve_prefix_cache_hits_total") == 20
    assert (await running.stub.GetModelInfo(pb.GetModelInfoRequest())).prefix_caching


async def test_metrics_port_in_use_fails_start_and_leaves_nothing_running():
    """A port clash must not leave an engine thread or a gRPC listener behind (they would keep
    the process from exiting); port 0 serves metrics on a free port, released at shutdown."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = (await start_server(metrics_port=0)).server
        await server.shutdown()
        with socket.socket() as again:  # shutdown released the metrics port
            again.bind(("127.0.0.1", server.metrics_port))
        from batchserve.async_engine import AsyncEngine
        from batchserve.server.app import BatchServer, ServerConfig

        engine = AsyncEngine(tiny_core())
        config = ServerConfig(port=0, http_port=0, metrics_port=taken.getsockname()[1])
        clash = BatchServer(engine, config, model_name="tiny")
        with pytest.raises(OSError):
            await clash.start()
        assert engine._task is None  # the step loop never started
        assert clash._server is None and clash.port is None  # nor did a gRPC listener


def test_jacobi_options_reach_the_sampling_params_unset_ones_stay_the_servers():
    from batchserve.server.grpc.convert import sampling_params

    assert sampling_params(build_request([1], jacobi=(3, None, 2))).jacobi == (3, None, 2)
    assert sampling_params(build_request([1])).jacobi is None


async def test_add_corpus_needs_the_admin_token_and_feeds_the_tenants_trie(tmp_path):
    from tests.server.test_trust import admin_token_file

    plain = await start_server()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await plain.stub.AddCorpus(pb.AddCorpusRequest(texts=["x"]))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "--admin-token-file" in e.value.details()
    finally:
        await plain.channel.close()
        await plain.server.shutdown()

    r = await start_server(admin_token_file=admin_token_file(tmp_path, "a-long-enough-s3cret-token"))
    try:
        call = r.stub.AddCorpus
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call(pb.AddCorpusRequest(texts=["x"]), metadata=(("x-batchserve-admin-token", "guess"),))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        auth = (("x-batchserve-admin-token", "a-long-enough-s3cret-token"),)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call(pb.AddCorpusRequest(token_ids=[pb.TokenIds(ids=[1, 999])]), metadata=auth)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        corpus = [pb.TokenIds(ids=[7, 8, 9, 10, 11, 12])]
        reply = await call(pb.AddCorpusRequest(token_ids=corpus, tenant="team-a"), metadata=auth)
        assert reply.sequences == 1
        drafter = r.core.speculation.drafter
        assert (7, 8) in (drafter.trie_counts("team-a") or {})
        assert drafter.stats()["scopes"] == ["team-a"]  # that tenant's scope only
    finally:
        await r.channel.close()
        await r.server.shutdown()


async def test_metrics_port_zero_turns_metrics_off_as_the_http_port_does():
    from batchserve.async_engine import AsyncEngine
    from batchserve.server.app import BatchServer, ServerConfig

    server = BatchServer(AsyncEngine(tiny_core()), ServerConfig(port=0, http_port=0, metrics_port=0), model_name="tiny")
    await server.start()
    try:
        assert server.metrics_port is None and server.metrics._http is None  # nothing listens for metrics
    finally:
        await server.shutdown()


async def test_metrics_and_their_health_serve_on_an_ipv6_host(running):
    """The metrics port takes the host's address family (`--host ::` serves both)."""
    try:
        socket.socket(socket.AF_INET6).bind(("::1", 0))
    except OSError:
        pytest.skip("this machine has no IPv6 loopback")
    port = running.server.metrics.serve(0, "::1", lambda: True)
    assert urllib.request.urlopen(f"http://[::1]:{port}/health", timeout=5).read() == b'{"status":"ok"}'
    assert (
        b"batchserve_num_requests_running" in urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=5).read()
    )
