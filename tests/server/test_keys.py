"""API keys bound to tenants (`--api-key-file`): the file's rules, the constant-time lookup, the
reload, and on a live server (HTTP and gRPC) that no call without a valid key reaches the engine,
that a key's tenant is the one its calls run as whatever they claim, and that without keys a
tenant header sent twice is refused."""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import json
from pathlib import Path

import grpc
import pytest

from batchserve.server.client import build_request
from batchserve.server.keys import ApiKeys, BadTenantHeader, KeyRing, Unauthenticated, request_tenant
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
        ("alice short", "at least 16"),
        ("alice sha256:abc", "64 hex digits"),
        (f"al ice {ALICE}", "line 1"),
        (f"a/b {ALICE}", "a tenant is"),
        (f"alice {ALICE}\nbob {ALICE}", "line 2: this key is already given"),
        ("# nothing\n", "no keys"),
    ]:
        with pytest.raises(ValueError, match=error):
            KeyRing.parse(text)


def test_a_reload_takes_a_good_file_and_keeps_the_keys_when_the_file_is_broken(tmp_path):
    path = _key_file(tmp_path)
    keys = ApiKeys(path)
    assert keys.authenticate([f"Bearer {ALICE}"]) == "alice"
    path.write_text(f"carol {ALICE}\n")  # rotated: alice's key now stands for carol, bob's is gone
    assert keys.reload() and keys.authenticate([f"Bearer {ALICE}"]) == "carol"
    with pytest.raises(Unauthenticated, match="invalid API key"):
        keys.authenticate([f"Bearer {BOB}"])
    path.write_text("broken\n")
    assert not keys.reload() and keys.authenticate([f"bearer {ALICE}"]) == "carol"
    path.unlink()
    assert not keys.reload() and keys.authenticate([f"Bearer {ALICE}"]) == "carol"
    with pytest.raises(ValueError, match="api key file"):
        ApiKeys(path)


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
