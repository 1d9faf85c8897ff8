"""Served rows: the bench's HTTP and gRPC clients against a running server (the tiny model), and
llama-server (a fake one, `llama_fakes`) restarted with --no-repack where it crashes."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from batchserve import SamplingParams
from batchserve.admission import Submission
from batchserve.bench import served, servers
from batchserve.bench.crashes import PeerFailed
from tests.bench.llama_fakes import fake_llama_server
from tests.conftest import make_ascii_model
from tests.server.conftest import start_server, tiny_core


async def test_the_served_clients_stream_what_the_engine_makes():
    # The model that writes ASCII: its streamed text is whole characters, as a real model's is.
    r = await start_server(tiny_core(model=make_ascii_model()), http=True, metrics_port=0)
    try:
        prompts = [[1 + i, 2, 3, 4] * (1 + i % 3) for i in range(5)]
        base, address = f"127.0.0.1:{r.server.http_port}", f"127.0.0.1:{r.server.port}"
        http_one = await asyncio.to_thread(served.run_http, base, prompts, 8, 1)
        http_many = await asyncio.to_thread(served.run_http, base, prompts, 8, 3)
        grpc_many = await asyncio.to_thread(served.run_grpc, address, prompts, 8, 3)
        expected = _direct(prompts)
        for run in (http_one, http_many, grpc_many):
            assert run.texts == expected  # in prompt order, whatever order the clients finished in
            assert run.tokens == 8 * len(prompts)  # the tiny model has no EOS: every request runs out
            assert len(run.ttfts) == len(prompts) and all(0 < t <= run.seconds for t in run.ttfts)
            assert len(run.tpots) == len(prompts) and all(t >= 0 for t in run.tpots)
        assert await asyncio.to_thread(served.served_model, base) == "tiny"
    finally:
        await r.channel.close()
        await r.server.shutdown()


def _direct(prompts: list[list[int]]) -> list[str]:
    """The same engine's text for each prompt, in-process (a second engine like the server's)."""
    core = tiny_core(model=make_ascii_model())
    ids = [core.add_request(Submission(p, SamplingParams(max_new_tokens=8))).request_id for p in prompts]
    tokens: dict[str, list[int]] = {}
    while core.has_work():
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [core.tokenizer.decode(tokens[i]) for i in ids]


async def test_a_failed_request_fails_the_run_with_the_servers_answer():
    r = await start_server(http=True, metrics_port=0)
    try:
        base = f"127.0.0.1:{r.server.http_port}"
        with pytest.raises(RuntimeError, match="400"):
            await asyncio.to_thread(served.run_http, base, [[1, 2], [10**9]], 4, 2)  # an id past the vocabulary
    finally:
        await r.channel.close()
        await r.server.shutdown()


def test_a_server_that_dies_at_start_says_why(tmp_path):
    cmd = [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"]
    with pytest.raises(RuntimeError, match="exited with 3 before it was ready:\nno model here"):
        with servers._process(cmd, "http://127.0.0.1:9/health", tmp_path / "log.txt"):
            pass


def test_llama_server_is_found_or_named_missing(tmp_path, monkeypatch):
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "nowhere"))
    assert servers.llama_server_binary() is None
    binary = tmp_path / "llama-server"
    binary.write_text("")
    monkeypatch.setenv("LLAMA_SERVER", str(binary))
    assert servers.llama_server_binary() == str(binary)
    assert "make bench-llama-server" in servers.LLAMA_SERVER_MISSING


def test_served_methods_are_peers_checked_against_the_plain_decoding_as_served():
    from batchserve.bench.methods import as_served, known_method
    from batchserve.bench.sweep import _needs_hf

    names = ["served-http", "served-grpc-none", "llama-server-ngram"]
    assert all(known_method(n) for n in names) and as_served(names, "gguf") == names
    # Their reference is the in-process `none` on make serve's weights, not HF greedy.
    assert not _needs_hf(["none-gguf", "lookahead-adaptive-gguf", *names])
    assert _needs_hf(["none-gguf", "llamacpp"]) and _needs_hf(["none"])


def test_the_report_sets_served_rows_against_the_same_settings_in_process():
    from batchserve.bench.methods import Row
    from batchserve.bench.served import served_table

    def row(method: str, b: int, tps: float, versus: str | None = None) -> Row:
        return Row(method, "humaneval", b, 8, 100, 1.0, tps, None, 0.1, 0.2, 0.01, 0.02, None, versus=versus)

    rows = [
        row("none-gguf", 1, 150.0), row("lookahead-adaptive-gguf", 1, 200.0),
        row("served-http", 1, 180.0, "lookahead-adaptive-gguf"), row("served-grpc-none", 1, 120.0, "none-gguf"),
        row("llama-server", 1, 90.0, "none-gguf"), row("served-http", 16, 300.0, "lookahead-adaptive-gguf"),
    ]  # fmt: skip
    lines = served_table(rows)
    body = [line for line in lines if line.startswith("| served") or line.startswith("| llama")]
    assert body == [
        "| served-http | 1 | 180.0 | lookahead-adaptive-gguf | 200.0 | 0.90x | 0.100 | 0.100 | 10.0 | 10.0 |",
        "| served-grpc-none | 1 | 120.0 | none-gguf | 150.0 | 0.80x | 0.100 | 0.100 | 10.0 | 10.0 |",
        "| llama-server | 1 | 90.0 | served-http | 180.0 | 0.50x | 0.100 | 0.100 | 10.0 | 10.0 |",
    ]  # served-http at 16 has no in-process row to stand against: left out


def _llama_server_peers(tmp_path: Path, mode: str) -> tuple[served.ServedPeers, Path]:
    """ServedPeers with a fake llama-server that crashes as `mode` says; the file listing its starts."""
    binary, starts = fake_llama_server(tmp_path, mode)
    gguf = tmp_path / "m.gguf"
    gguf.touch()
    return served.ServedPeers(None, "float32", 16, tmp_path / "logs", (str(binary), gguf)), starts


PROMPTS = [[1, 2], [3, 4], [5]]


@pytest.mark.parametrize(("mode", "stage"), [("request", "while serving"), ("start", "before it was ready")])
def test_llama_server_killed_by_sigill_restarts_with_no_repack_and_the_rows_say_so(
    tmp_path: Path, mode: str, stage: str
) -> None:
    peers, starts = _llama_server_peers(tmp_path, mode)
    with peers:
        row = peers.row("llama-server", "humaneval", 2, PROMPTS, 4, [], None)
        later = peers.row("llama-server-ngram", "humaneval", 2, PROMPTS, 4, [], None)
    assert row.num_prompts == 3 and row.output_tokens == 6 and later.output_tokens == 6  # "ab" each
    note = f"llama.cpp's AMX/repacked kernels crashed (SIGILL) {stage}; restarted with --no-repack"
    assert row.note == later.note == note
    started = starts.read_text().splitlines()
    assert ["--no-repack" in s for s in started] == [False, True, True]  # later starts take it at once
    assert "--spec-type" in started[2]
    assert (tmp_path / "logs" / "llama-server-b2-no-repack.log").is_file()


def test_llama_server_failing_both_ways_raises_with_both_reasons_without_hanging(tmp_path: Path) -> None:
    peers, starts = _llama_server_peers(tmp_path, "always")
    t0 = time.monotonic()
    with peers, pytest.raises(PeerFailed) as failed:
        peers.row("llama-server", "humaneval", 2, PROMPTS, 4, [], None)
    assert time.monotonic() - t0 < 60
    assert str(failed.value).startswith(
        "llama-server crashed (SIGILL) while serving on its default kernels, "
        "and crashed (SIGILL) while serving with --no-repack (logs: "
    )
    assert ["--no-repack" in s for s in starts.read_text().splitlines()] == [False, True]
    assert peers.no_repack is None


def test_llama_server_that_exits_without_a_signal_is_not_restarted(tmp_path: Path) -> None:
    peers, starts = _llama_server_peers(tmp_path, "exit")
    with peers, pytest.raises(PeerFailed, match=r"^llama-server exited with status 3 before it was ready$"):
        peers.row("llama-server", "humaneval", 1, PROMPTS, 4, [], None)
    assert len(starts.read_text().splitlines()) == 1


def test_a_server_that_dies_while_serving_says_so(tmp_path: Path) -> None:
    binary, _ = fake_llama_server(tmp_path, "request")
    server = servers.LlamaServer(str(binary), tmp_path / "m.gguf", 1, 64, 1, False, tmp_path / "log.txt")
    with pytest.raises(servers.ServerDied, match=r"crashed \(SIGILL\) while serving") as died:
        with servers.llama_server(server) as base:
            served.run_http(base, PROMPTS, 4, 1)
    assert died.value.returncode == -4 and died.value.reason == "crashed (SIGILL) while serving"
    with servers.llama_server(replace(server, no_repack=True)) as base:
        assert served.run_http(base, PROMPTS, 4, 1).texts == ["ab"] * 3
