"""API keys bound to tenants (`--api-key-file`): the file's rules, the constant-time lookup, the
reload, and on a live server (HTTP and gRPC) that no call without a valid key reaches the engine,
that a key's tenant is the one its calls run as whatever they claim, and that without keys a
tenant header sent twice is refused."""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
import threading
import time
from pathlib import Path

import grpc
import pytest

from batchserve.server.client import build_request
from batchserve.server.keys import ApiKeys, BadTenantHeader, KeyRing, Unauthenticated, key_bits, request_tenant
from batchserve.v1 import generation_pb2 as pb
from tests.server.conftest import start_server
from tests.server.test_trust import _tenants

ALICE, BOB = "alice-key-0123456789abcdef", "bob-key-0123456789abcdef"


def _key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    bob_digest = hashlib.sha256(BOB.encode()).hexdigest()
    path.write_text(f"# tenant key\nalice {ALICE}\n\nbob sha256:{bob_digest}\n")
    return path


def test_the_file_takes_plain_and_hashed_keys_and_names_the_line_of_anything_else():
    ring = KeyRing.parse(f"alice {ALICE}\nbob sha256:{hashlib.sha256(BOB.encode()).hexdigest()}\n")
    assert ring.tenant_of(ALICE) == "alice" and ring.tenant_of(BOB) == "bob"
    assert ring.tenant_of(ALICE[:-1]) is None and ring.tenant_of("") is None
    assert all(len(digest) == 32 for digest, _ in ring.entries)  # only digests are kept
    for text, error in [
        ("alice", "line 1: expected `TENANT KEY`"),
        (f"alice {ALICE} extra", "line 1: expected `TENANT KEY`"),
        ("alice short", "too easy to guess"),
        ("alice sha256:abc", "64 hex digits"),
        (f"al ice {ALICE}", "line 1"),
        (f"a/b {ALICE}", "a tenant is"),
        (f"alice {ALICE}\nbob {ALICE}", "line 2: this key is already given"),
        ("# nothing\n", "no keys"),
    ]:
        with pytest.raises(ValueError, match=error):
            KeyRing.parse(text)


def test_a_reload_takes_a_good_file_and_a_broken_empty_or_missing_one_revokes_every_key(tmp_path):
    """Fail closed: a reload that does not read leaves no key in force (a removed key must never
    outlive its removal because the new file was broken), until a good file is read again."""
    path = _key_file(tmp_path)
    keys = ApiKeys(path)
    assert keys.authenticate([f"Bearer {ALICE}"]) == "alice"
    path.write_text(f"carol {ALICE}\n")  # rotated: alice's key now stands for carol, bob's is gone
    assert keys.reload() and keys.authenticate([f"Bearer {ALICE}"]) == "carol"
    with pytest.raises(Unauthenticated, match="invalid API key"):
        keys.authenticate([f"Bearer {BOB}"])
    for broken in ("broken\n", "", "# only a comment\n", None):
        if broken is None:
            path.unlink()
        else:
            path.write_text(broken)
        assert not keys.reload()
        for key in (ALICE, BOB):
            with pytest.raises(Unauthenticated, match="invalid API key"):
                keys.authenticate([f"Bearer {key}"])
    path.write_text(f"alice {ALICE}\n")
    assert keys.reload() and keys.authenticate([f"Bearer {ALICE}"]) == "alice"
    path.unlink()
    with pytest.raises(ValueError, match="api key file"):
        ApiKeys(path)


def test_keys_under_128_bits_by_their_alphabet_are_refused():
    for key, bits in [("0123456789abcdef" * 2, 128), ("Zm9vYmFyYmF6cXV4cXV1eA", 132), ("a-b_c" * 5, 0)]:
        assert key_bits(key) == bits
    for weak in ["0123456789abcdef0123456789abcde", "Zm9vYmFyYmF6cXV4cXV1e", "correct-horse-battery", "a" * 64]:
        with pytest.raises(ValueError, match="too easy to guess"):
            KeyRing.parse(f"alice {weak}")
    for strong in ["0123456789abcdef" * 2, "Zm9vYmFyYmF6cXV4cXV1eA", "p@ss~w0rd!#$%^&*()?<"]:
        assert KeyRing.parse(f"alice {strong}").tenant_of(strong) == "alice"


def test_a_key_file_others_may_read_is_warned_of(tmp_path, caplog):
    path = _key_file(tmp_path)
    path.chmod(0o600)
    with caplog.at_level("WARNING", logger="batchserve"):
        ApiKeys(path)
    assert "open to others" not in caplog.text
    path.chmod(0o644)
    with caplog.at_level("WARNING", logger="batchserve"):
        ApiKeys(path)
    assert "open to others (mode 644)" in caplog.text


def test_the_tenant_is_the_keys_whatever_the_call_claims_and_a_header_counts_once():
    keys = ApiKeys.__new__(ApiKeys)
    keys.ring = KeyRing.parse(f"alice {ALICE}")
    assert request_tenant(keys, [f"Bearer {ALICE}"], ["bob", "carol"], "bob", "both") == "alice"
    for authorization, why in [([], "missing"), ([f"Bearer {ALICE}"] * 2, "more than one"), ([ALICE], "Bearer KEY")]:
        with pytest.raises(Unauthenticated, match=why):
            request_tenant(keys, authorization, [], None, "header")
    assert request_tenant(None, [], ["gw"], "body", "both") == "gw"
    with pytest.raises(BadTenantHeader, match="sent 2 times"):
        request_tenant(None, [], ["gw", "client"], None, "header")


def _http(port: int, path: str, body: object | None, headers: list[tuple[str, str]]) -> tuple[int, dict, dict]:
    """One call with headers as given (a header may repeat)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.putrequest("POST" if body is not None else "GET", path)
    data = json.dumps(body).encode() if body is not None else b""
    for name, value in [("Content-Type", "application/json"), ("Content-Length", str(len(data))), *headers]:
        conn.putheader(name, value)
    conn.endheaders(data)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw) if raw else {}, dict(resp.getheaders())


async def test_with_keys_no_call_without_a_valid_key_reaches_the_engine(tmp_path, monkeypatch):
    r = await start_server(http=True, api_key_file=str(_key_file(tmp_path)), tenant_source="both")
    seen = await _tenants(r, monkeypatch)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "user": "bob"}
    port = r.server.http_port

    async def call(path: str, payload: object | None, *headers: tuple[str, str]) -> tuple[int, dict, dict]:
        return await asyncio.to_thread(_http, port, path, payload, list(headers))

    try:
        for headers in [(), (("Authorization", "Bearer wrong-key-0123456789abcdef"),), (("Authorization", ALICE),)]:
            code, reply, response_headers = await call("/v1/completions", body, *headers)
            assert code == 401 and reply["error"]["code"] == "invalid_api_key", reply
            assert response_headers.get("www-authenticate") == "Bearer"
            assert (await call("/v1/models", None, *headers))[0] == 401
        assert (await call("/health", None))[0] == 200  # probes need no key
        # A valid key: its tenant, whatever header or user the call also sends.
        spoof = ("x-batchserve-tenant", "bob")
        code, _, _ = await call("/v1/completions", body, ("Authorization", f"Bearer {ALICE}"), spoof, spoof)
        assert code == 200
        metadata = (("x-batchserve-tenant", "bob"),)
        for bad in [metadata, (("authorization", "Bearer nope-0123456789abcdef"),)]:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await r.stub.Generate(build_request([1, 2], max_new_tokens=2, tenant="bob"), metadata=bad)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for rpc, request in [(r.stub.Tokenize, pb.TokenizeRequest(text="x")), (r.stub.GetModelInfo, None)]:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await rpc(request or pb.GetModelInfoRequest())
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = (("authorization", f"Bearer {BOB}"), ("x-batchserve-tenant", "alice"))
        await r.stub.Generate(build_request([1, 2], max_new_tokens=2, tenant="alice"), metadata=good)
        assert (await r.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=good)).vocab_size > 0
        assert seen == ["alice", "bob"]  # nothing else reached the engine, each as its key's tenant
    finally:
        await r.channel.close()
        await r.server.shutdown()


async def test_without_keys_a_tenant_header_sent_twice_is_refused(monkeypatch):
    r = await start_server(http=True)
    seen = await _tenants(r, monkeypatch)
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    twice = [("x-batchserve-tenant", "client"), ("x-batchserve-tenant", "gateway")]
    try:
        code, reply, _ = await asyncio.to_thread(_http, r.server.http_port, "/v1/completions", body, twice)
        assert code == 400 and "sent 2 times" in reply["error"]["message"]
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await r.stub.Generate(build_request([1, 2], max_new_tokens=2), metadata=tuple(twice))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        code, _, _ = await asyncio.to_thread(_http, r.server.http_port, "/v1/completions", body, twice[:1])
        assert code == 200 and seen == ["client"]
    finally:
        await r.channel.close()
        await r.server.shutdown()


async def _tokens_to_end(call: grpc.aio.UnaryStreamCall) -> int:
    n = 0
    while (message := await call.read()) is not grpc.aio.EOF:
        n += len(message.token_ids)
    return n


def _stream_until_cut(port: int, key: str, first: threading.Event) -> tuple[bool, float]:
    """A streamed completion under `key`: sets `first` at its first event, then reads on; whether it
    ended with [DONE], and the seconds from `first` to its end."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 600, "stream": True})  # no EOS: all 600
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    conn.request("POST", "/v1/completions", body=body, headers=headers)
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    resp.readline()
    first.set()
    t, done = time.monotonic(), False
    try:
        for line in resp:
            done = done or line.startswith(b"data: [DONE]")
    except (http.client.IncompleteRead, ConnectionError):
        pass
    conn.close()
    return done, time.monotonic() - t


async def test_removing_a_key_ends_its_running_calls_on_both_front_ends_at_the_reload(tmp_path, monkeypatch):
    """Alice's gRPC stream, her unary call and her HTTP stream end when a reload removes her key
    (UNAUTHENTICATED; the HTTP stream stops short of [DONE]), and their engine requests are freed;
    Bob's stream, whose key stays, runs to its end."""
    from tests.server.conftest import tiny_core

    path = _key_file(tmp_path)
    r = await start_server(tiny_core(max_num_seqs=4), http=True, api_key_file=str(path))
    execute = r.core.execute
    monkeypatch.setattr(r.core, "execute", lambda step: (time.sleep(0.02), execute(step))[1])  # steps of 20 ms
    alice, bob = (("authorization", f"Bearer {ALICE}"),), (("authorization", f"Bearer {BOB}"),)
    long = build_request([1, 2, 3], max_new_tokens=600, ignore_eos=True)
    try:
        stream = r.stub.StreamGenerate(long, metadata=alice)
        await stream.read()
        unary = asyncio.ensure_future(r.stub.Generate(long, metadata=alice))
        kept = r.stub.StreamGenerate(build_request([4, 5], max_new_tokens=200, ignore_eos=True), metadata=bob)
        await kept.read()
        first = threading.Event()
        cut = asyncio.ensure_future(asyncio.to_thread(_stream_until_cut, r.server.http_port, ALICE, first))
        for _ in range(500):
            if first.is_set():
                break
            await asyncio.sleep(0.02)
        assert first.is_set() and r.core.scheduler.num_running == 4
        path.write_text(f"bob sha256:{hashlib.sha256(BOB.encode()).hexdigest()}\n")
        assert r.server.keys.reload()
        t = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await _tokens_to_end(stream)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "revoked" in e.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await unary
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        done, seconds = await cut
        assert not done and seconds < 5 and time.monotonic() - t < 5
        assert await _tokens_to_end(kept) >= 150  # Bob's runs on to its end
        for _ in range(100):
            if not r.core.scheduler.num_running and not r.core.scheduler.num_waiting:
                break
            await asyncio.sleep(0.05)
        assert not r.core.scheduler.num_running and not r.core.scheduler.num_waiting
    finally:
        await r.channel.close()
        await r.server.shutdown()
