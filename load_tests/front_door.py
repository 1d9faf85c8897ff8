"""The front door on loopback (`make front-door`): the real HAProxy (deploy/haproxy) in front of
three `batchserve serve` replicas, checked end to end.

    .venv/bin/python load_tests/front_door.py [--model PATH] [--out front_door_out]

Checks, each through the proxy:
- a call without a key, or with an unknown one, is refused (HTTP 401 `invalid_api_key`, gRPC
  UNAUTHENTICATED) and reaches no replica;
- a client's own tenant header (sent once, or twice) is replaced by its key's tenant, never
  appended: the replica runs the request under the key's tenant;
- each tenant's requests land on one replica (consistent hashing on the tenant), and tenants
  spread over the replicas;
- when a tenant's replica dies (SIGKILL) mid-stream, the failover Client resumes the stream
  through the proxy on another replica, and the whole output equals the undisturbed one.
Which replica ran a request, under which tenant, is read from the replicas' own logs (a request's
engine id ends with 12 hex digits of its tenant's SHA-256). Exits non-zero on any failure.
"""

from __future__ import annotations

import argparse
import hashlib
import http.client
import json
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from batchserve.server.client import Client, build_request  # noqa: E402
from deploy.haproxy import render  # noqa: E402

TENANTS = [f"tenant{i}" for i in range(12)]
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def tag(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()[:12]


class Replica:
    def __init__(self, index: int, model: str | None, out: Path, extra: list[str]) -> None:
        self.index = index
        self.grpc, self.http = free_ports(2)
        self.log_path = out / f"replica-{index}.log"
        args = [sys.executable, "-m", "batchserve.cli", "serve", "--host", "127.0.0.1", "--port", str(self.grpc),
                "--http-port", str(self.http), "--metrics-port", "0"]  # fmt: skip
        args += ["--model", model, *extra] if model else extra
        self.proc = subprocess.Popen(args, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, cwd=ROOT)

    def wait_healthy(self, timeout: float = 300) -> None:
        wait_serving(f"127.0.0.1:{self.grpc}", timeout, self.proc)

    def ran(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def start_proxy(
    out: Path, keys_map: Path, replicas: list[str], limits: render.Limits, tls: tuple[str, str | None] | None = None
) -> tuple[subprocess.Popen, int, int]:
    """HAProxy on free loopback ports before `replicas` (HOST:GRPC:HTTP), its config and log in
    `out`, once its admin socket is up (after its listeners): (the proxy, its gRPC port, its HTTP
    port). Whether it serves depends on its replicas' health: `wait_serving` for that."""
    front_grpc, front_http = free_ports(2)
    cfg = render.config(str(keys_map), replicas, None, f"127.0.0.1:{front_http}", f"127.0.0.1:{front_grpc}",
                        limits, tls)  # fmt: skip
    (out / "haproxy.cfg").write_text(cfg)
    log = open(out / "haproxy.log", "w")
    proxy = subprocess.Popen(["haproxy", "-db", "-f", str(out / "haproxy.cfg")], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while not Path(limits.admin_socket).exists() and proxy.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proxy, front_grpc, front_http


def wait_serving(target: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(target))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{target} exited during start-up")
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{target} not serving after {timeout:.0f} s")


def post(port: int, path: str, body: dict | None, headers: list[tuple[str, str]]) -> tuple[int, dict]:
    """One HTTP call (GET without a body), headers sent as given: a name may repeat."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.putrequest("POST" if body is not None else "GET", path)
    for name, value in [("content-type", "application/json"), *headers]:
        conn.putheader(name, value)
    data = json.dumps(body).encode() if body is not None else b""
    conn.putheader("content-length", str(len(data)))
    conn.endheaders(data)
    resp = conn.getresponse()
    raw = resp.read()
    conn.close()
    return resp.status, json.loads(raw) if raw else {}


def where(replicas: list[Replica], request_id: str) -> list[tuple[int, str]]:
    """(replica, tenant tag) of each finished request `request_id` in the replicas' logs."""
    pattern = re.compile(rf"request {re.escape(request_id)}\.([0-9a-f]{{12}}) finished")
    return [(r.index, m.group(1)) for r in replicas for m in pattern.finditer(r.ran())]


class Checks:
    def __init__(self) -> None:
        self.failed: list[str] = []

    def check(self, ok: bool, what: str) -> None:
        print(("ok     " if ok else "FAILED ") + what, flush=True)
        if not ok:
            self.failed.append(what)


def run(model: str | None, out: Path, extra: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    keys = {t: secrets.token_urlsafe(24) for t in TENANTS}
    (out / "keys.txt").write_text("".join(f"{t} {k}\n" for t, k in keys.items()))
    (out / "keys.map").write_text(render.keys((out / "keys.txt").read_text()))
    replicas = [Replica(i, model, out, extra) for i in range(3)]
    proxy: subprocess.Popen | None = None
    c = Checks()
    try:
        for r in replicas:
            r.wait_healthy()
        limits = render.Limits(conn_per_source=16, admin_socket=str(out / "admin.sock"), request_seconds=2)
        servers = [f"127.0.0.1:{r.grpc}:{r.http}" for r in replicas]
        proxy, front_grpc, front_http = start_proxy(out, out / "keys.map", servers, limits)
        wait_serving(f"127.0.0.1:{front_grpc}", 30, proxy)
        target = f"127.0.0.1:{front_grpc}"
        _refusals(c, target, front_http, replicas, keys)
        _spoofing(c, target, front_http, replicas, keys)
        homes = _affinity(c, target, replicas, keys)
        _door(c, target, front_http, keys, out)
        _failover(c, target, replicas, keys, homes)
    finally:
        if proxy is not None:
            proxy.terminate()
            proxy.wait(timeout=10)
        for r in replicas:
            r.stop()
    print(f"{len(c.failed)} failed" if c.failed else "every check passed", flush=True)
    return 1 if c.failed else 0


def _refusals(c: Checks, target: str, http_port: int, replicas: list[Replica], keys: dict[str, str]) -> None:
    for key in (None, "not-a-key-of-anyone-here"):
        with Client(target, timeout=30, failover=0, api_key=key) as client:
            try:
                client.generate(PROMPT, max_new_tokens=2, request_id="refused-1")
                code = None
            except grpc.RpcError as e:
                code = e.code()
        c.check(code == grpc.StatusCode.UNAUTHENTICATED, f"gRPC with key {key!r}: UNAUTHENTICATED (got {code})")
    status, reply = post(http_port, "/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 2}, [])
    c.check(status == 401 and reply["error"]["code"] == "invalid_api_key", f"HTTP without a key: 401 (got {status})")
    c.check(not where(replicas, "refused-1"), "no refused call reached a replica")


def _spoofing(c: Checks, target: str, http_port: int, replicas: list[Replica], keys: dict[str, str]) -> None:
    with Client(target, timeout=120, api_key=keys["tenant0"]) as client:
        client.generate(PROMPT, max_new_tokens=2, request_id="spoof-1", tenant="tenant1")
    ran = where(replicas, "spoof-1")
    c.check([t for _, t in ran] == [tag("tenant0")], f"a spoofed gRPC tenant runs as the key's tenant ({ran})")
    status, models = post(http_port, "/v1/models", None, [("authorization", f"Bearer {keys['tenant0']}")])
    c.check(status == 200, f"the OpenAI API answers a key through the proxy (HTTP {status})")
    body = {"model": models["data"][0]["id"], "prompt": "x", "max_tokens": 2}
    headers = [("authorization", f"Bearer {keys['tenant0']}"), ("x-batchserve-tenant", "tenant1"),
               ("x-batchserve-tenant", "tenant2")]  # fmt: skip
    status, _ = post(http_port, "/v1/completions", body, headers)
    c.check(status == 200, f"a tenant header sent twice is replaced, not appended (HTTP {status}, not 400)")


def _affinity(c: Checks, target: str, replicas: list[Replica], keys: dict[str, str]) -> dict[str, int]:
    homes: dict[str, int] = {}
    for tenant in TENANTS:
        with Client(target, timeout=120, api_key=keys[tenant]) as client:
            for i in range(3):
                client.generate(PROMPT, max_new_tokens=2, request_id=f"aff-{tenant}-{i}")
        ran = {where(replicas, f"aff-{tenant}-{i}")[0][0] for i in range(3)}
        c.check(len(ran) == 1, f"{tenant}'s requests land on one replica ({sorted(ran)})")
        homes[tenant] = min(ran)
    spread = sorted(set(homes.values()))
    c.check(len(spread) >= 2, f"tenants spread over the replicas ({spread})")
    return homes


def _door(c: Checks, target: str, http_port: int, keys: dict[str, str], out: Path) -> None:
    """Before any key: an address past its share of connections is closed unread, a trickled head
    is closed at the deadline, health streams without a key do not stop a keyed call; then a key
    removed from the map (keys_sync.py, no restart) is refused within 5 s."""
    from deploy.haproxy import keys_sync

    attacker = ("127.0.0.2", 0)
    held = [socket.create_connection(("127.0.0.1", http_port), source_address=attacker) for _ in range(16)]
    try:
        extra = socket.create_connection(("127.0.0.1", http_port), source_address=attacker, timeout=5)
        refused = _closed(extra, 5)
    except ConnectionResetError:  # reset as it was accepted
        refused = True
    c.check(refused, "a connection past its address's share is closed unread")
    held[0].sendall(b"GET /health HTTP/1.1\r\n")  # a head that never ends
    held[1].sendall(b'POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{"model"')  # nor a body
    c.check(
        all(_closed(sock, 6) for sock in held), "idle, trickling and slow-body connections are closed at the deadline"
    )
    health = grpc.insecure_channel(target)
    watches = [health.unary_stream("/grpc.health.v1.Health/Watch")(b"") for _ in range(50)]
    with Client(target, timeout=60, api_key=keys["tenant1"]) as client:
        ok = len(client.generate(PROMPT, max_new_tokens=2, request_id="door-1").token_ids) == 2
    c.check(ok, "a keyed call is served beside 50 health streams without a key")
    for watch in watches:
        watch.cancel()
    health.close()
    channel = grpc.insecure_channel(target)  # a long stream under the key about to go
    running = channel.unary_stream("/batchserve.v1.TextGeneration/StreamGenerate")(
        build_request(PROMPT, max_new_tokens=4000, ignore_eos=True).SerializeToString(),
        metadata=(("authorization", f"Bearer {keys['tenant2']}"),),
        timeout=120,
    )
    next(running)
    (out / "keys.map").write_text(render.keys("".join(f"{t} {k}\n" for t, k in keys.items() if t != "tenant2")))
    t = time.monotonic()
    keys_sync.sync_file(str(out / "admin.sock"), out / "keys.map")
    try:
        for _ in running:
            pass
        cut = "ran to its end"
    except grpc.RpcError as e:
        cut = f"{e.code().name} after {time.monotonic() - t:.1f} s"
    channel.close()
    c.check(cut.endswith(" s") and time.monotonic() - t < 5, f"a stream under the removed key is ended ({cut})")
    with Client(target, timeout=30, failover=0, api_key=keys["tenant2"]) as client:
        try:
            client.generate(PROMPT, max_new_tokens=2, request_id="revoked-1")
            code = None
        except grpc.RpcError as e:
            code = e.code()
    seconds = time.monotonic() - t
    c.check(
        code == grpc.StatusCode.UNAUTHENTICATED and seconds < 5, f"a removed key is refused ({code}, {seconds:.1f} s)"
    )


def _closed(sock: socket.socket, seconds: float) -> bool:
    """Whether the proxy closes `sock` (EOF or reset) within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(1024):
            pass
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return False
    finally:
        sock.close()
    return True


def _failover(c: Checks, target: str, replicas: list[Replica], keys: dict[str, str], homes: dict[str, int]) -> None:
    tenant = "tenant3"
    home = replicas[homes[tenant]]
    # One token a step and far more steps than a message's trip through the proxy takes: the
    # replica cannot have sent the whole answer before the kill lands (48 drafted tokens could).
    kwargs = {"max_new_tokens": 600, "ignore_eos": True, "lookahead": False}
    with Client(target, timeout=300, api_key=keys[tenant]) as client:
        whole = list(client.generate(PROMPT, request_id="whole", **kwargs).token_ids)
        got: list[int] = []
        for msg in client.stream(PROMPT, request_id="broken", **kwargs):
            got.extend(msg.token_ids)
            if home.proc.poll() is None:
                home.proc.send_signal(signal.SIGKILL)  # its replica dies mid-stream
        c.check(client.failovers >= 1, f"the broken stream was resumed ({client.failovers} failovers)")
        c.check(got == whole, f"the resumed stream equals the undisturbed one ({len(got)} vs {len(whole)} tokens)")
        client.generate(PROMPT, max_new_tokens=2, request_id="after")
    moved = [i for i, _ in where(replicas, "after")]
    c.check(bool(moved) and moved[0] != home.index, f"the tenant moved to a live replica ({moved})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="what the replicas serve (default: batchserve serve's default)")
    parser.add_argument("--out", type=Path, default=Path("front_door_out"))
    parser.add_argument("extra", nargs="*", help="more `batchserve serve` flags (after --)")
    args = parser.parse_args()
    return run(args.model, args.out, args.extra)


if __name__ == "__main__":
    raise SystemExit(main())
