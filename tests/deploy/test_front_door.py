"""The front door (deploy/haproxy): the Kubernetes config is what render.py writes, and on
loopback the real HAProxy in front of three replicas refuses calls without a key, replaces a
spoofed tenant header, keeps each tenant on one replica and resumes a stream exactly when that
replica dies (load_tests/front_door.py, also `make front-door`)."""

from __future__ import annotations

import http.client
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from deploy.haproxy import render
from load_tests import front_door
from tests.deploy.test_replicas import model_dir  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[2]
KUBE_CFG = ROOT / "deploy" / "kubernetes" / "overlays" / "front-door" / "haproxy.cfg"
KEY, OTHER = "0123456789abcdef" * 2, "fedcba9876543210" * 2
NO_HAPROXY = "HAProxy is not installed (`apt-get install haproxy`; `make setup` installs it where it can)"


def _kube_config() -> str:
    return render.config(
        "/etc/haproxy/keys/keys.map",
        [],
        "batchserve-headless.default.svc.cluster.local:50051:8000:16",
        ":8080",
        ":50051",
        tls=("/etc/haproxy/replica-tls/ca.crt", "/etc/haproxy/replica-tls/proxy.pem"),
    )


def test_the_kubernetes_config_is_what_render_writes() -> None:
    lines = KUBE_CFG.read_text().splitlines(keepends=True)
    assert lines[0].startswith("# Rendered by") and "".join(lines[3:]) == _kube_config()


def test_render_refuses_no_replicas_and_a_bad_key_file(tmp_path) -> None:
    with pytest.raises(ValueError, match="name the replicas"):
        render.config("/k", [], None, ":1", ":2")
    with pytest.raises(ValueError, match="line 1"):
        render.keys("acme short\n")
    assert render.keys(f"acme {KEY}\n") == f"{render.sha256_hex(KEY)} acme\n"


@pytest.mark.skipif(shutil.which("haproxy") is None or shutil.which("openssl") is None, reason=NO_HAPROXY)
def test_haproxy_takes_both_configs(tmp_path) -> None:
    from tests.server.test_shutdown_tls import _certificate

    keys = tmp_path / "keys.map"
    keys.write_text(render.keys(f"acme {KEY}\n"))
    cert, key = _certificate(tmp_path, "proxy")
    (tmp_path / "proxy.pem").write_text(Path(cert).read_text() + Path(key).read_text())
    kube = _kube_config().replace("/etc/haproxy/keys/keys.map", str(keys))
    kube = kube.replace("/etc/haproxy/replica-tls/ca.crt", cert).replace("/etc/haproxy/replica-tls/", f"{tmp_path}/")
    for name, text in (
        ("kube.cfg", kube),
        ("loopback.cfg", render.config(str(keys), ["127.0.0.1:1:2", "127.0.0.1:3:4"], None, ":18080", ":18051")),
    ):
        (tmp_path / name).write_text(text)
        done = subprocess.run(["haproxy", "-c", "-f", str(tmp_path / name)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("haproxy") is None, reason=NO_HAPROXY)
def test_the_front_door_on_loopback(model_dir, tmp_path, capsys) -> None:  # noqa: F811
    code = front_door.run(str(model_dir), tmp_path / "out", ["--kv-cache-gb", "0.02"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert printed.count("\nok ") + printed.startswith("ok ") >= 20 and "FAILED" not in printed


def _status(port: int, key: str, source: str = "127.0.0.1") -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer {key}"})
    status = conn.getresponse().status
    conn.close()
    return status


@pytest.mark.skipif(shutil.which("haproxy") is None, reason=NO_HAPROXY)
def test_the_proxy_reloads_its_key_map_in_place_and_limits_each_address(tmp_path) -> None:
    """keys_sync.py swaps the map through the admin socket (a removed key is refused, an added one
    taken, a broken file revokes every key) with no restart; one address holds at most its share
    of connections, and a connection that never completes its request is closed at the deadline.
    No replica runs: a known key's call reaches the empty backend (503), an unknown one is 401."""
    from deploy.haproxy import keys_sync

    keys = tmp_path / "keys.map"
    keys.write_text(render.keys(f"acme {KEY}\n"))
    sock = str(tmp_path / "admin.sock")
    limits = render.Limits(conn_per_source=4, rate_per_source=1000, admin_socket=sock, request_seconds=1)
    proxy, _, http_port = front_door.start_proxy(tmp_path, keys, ["127.0.0.1:1:2"], limits)
    try:
        assert _status(http_port, KEY) == 503 and _status(http_port, OTHER) == 401
        keys.write_text(render.keys(f"other {OTHER}\n"))  # KEY removed, OTHER added
        assert keys_sync.sync_file(sock, keys)
        assert _status(http_port, KEY) == 401 and _status(http_port, OTHER) == 503
        assert not keys_sync.sync_file(sock, keys)  # the same as HAProxy holds: nothing sent
        keys.write_text("not a map\n")
        assert keys_sync.sync_file(sock, keys)
        assert _status(http_port, OTHER) == 401  # fail closed
        held = [socket.create_connection(("127.0.0.1", http_port), source_address=("127.0.0.2", 0)) for _ in range(4)]
        extra = socket.create_connection(("127.0.0.1", http_port), source_address=("127.0.0.2", 0))
        assert front_door._closed(extra, 3)  # the fifth from that address: closed unread
        assert _status(http_port, KEY) == 401  # another address is served meanwhile
        assert all(front_door._closed(s, 4) for s in held)  # no request within the 1 s deadline
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)


@pytest.mark.skipif(shutil.which("haproxy") is None or shutil.which("openssl") is None, reason=NO_HAPROXY)
async def test_the_proxy_talks_mutual_tls_to_a_replica_that_requires_it(tmp_path) -> None:
    """render.py's --replica-ca and --replica-client-cert: a replica that takes only clients with a
    certificate of its CA (--tls-client-ca) passes the proxy's health checks and answers its calls
    over HTTP and gRPC; without the proxy's certificate it would refuse them."""
    import asyncio

    import grpc

    from batchserve.server.client import build_request
    from batchserve.v1 import generation_pb2_grpc as pb_grpc
    from tests.server.conftest import start_server
    from tests.server.test_shutdown_tls import _certificate

    cert, key = _certificate(tmp_path, "replica")
    client_cert, client_key = _certificate(tmp_path, "proxy")
    proxy_pem = tmp_path / "proxy.pem"
    proxy_pem.write_text(Path(client_cert).read_text() + Path(client_key).read_text())
    keys = tmp_path / "keys.map"
    keys.write_text(render.keys(f"acme {KEY}\n"))
    r = await start_server(http=True, tls_cert=cert, tls_key=key, tls_client_ca=client_cert)
    replica = f"127.0.0.1:{r.server.port}:{r.server.http_port}"
    limits = render.Limits(admin_socket=str(tmp_path / "admin.sock"))
    proxy, grpc_port, http_port = front_door.start_proxy(tmp_path, keys, [replica], limits, (cert, str(proxy_pem)))
    try:
        status = 0
        for _ in range(100):  # until the proxy listens, and a health check over mTLS put the replica in
            try:
                status = await asyncio.to_thread(_status, http_port, KEY)
            except ConnectionRefusedError:
                status = 0
            if status == 200:
                break
            await asyncio.sleep(0.1)
        assert status == 200
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            reply = await pb_grpc.TextGenerationStub(channel).Generate(
                build_request([1, 2], max_new_tokens=3), metadata=(("authorization", f"Bearer {KEY}"),), timeout=30
            )
        assert reply.usage.completion_tokens == 3
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        await r.channel.close()
        await r.server.shutdown()
