"""The front door's key sidecar (deploy/haproxy/keys_sync.py): on the real HAProxy, a key removed
from the map has its running calls ended while another key's run on; the Secret is followed
through the Kubernetes API's list and watch (a stand-in API server), deletion included."""

from __future__ import annotations

import base64
import http.client
import http.server
import json
import queue
import secrets
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from deploy.haproxy import keys_sync, render
from load_tests import front_door
from tests.deploy.test_front_door import KEY, NO_HAPROXY, OTHER


class _Streams(http.server.BaseHTTPRequestHandler):
    """A replica stand-in: every GET is a chunked answer of a chunk each 0.1 s for 30 s."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        if self.path == "/health":  # the proxy's check
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for _ in range(300):
                self.wfile.write(b"2\r\nok\r\n")
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:  # the proxy cut it
            pass

    def log_message(self, *args: Any) -> None:
        pass


def _read_until_cut(conn: http.client.HTTPConnection, done: dict[str, float], name: str) -> None:
    try:
        resp = conn.getresponse()
        while resp.read1(64):
            pass
    except (OSError, http.client.HTTPException):
        pass
    done[name] = time.monotonic()


@pytest.mark.skipif(shutil.which("haproxy") is None, reason=NO_HAPROXY)
def test_a_removed_key_has_its_running_calls_ended_and_another_key_runs_on(tmp_path: Path) -> None:
    backend = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Streams)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    keys = tmp_path / "keys.map"
    keys.write_text(render.keys(f"acme {KEY}\nother {OTHER}\n"))
    sock = str(tmp_path / "admin.sock")
    servers = [f"127.0.0.1:1:{backend.server_address[1]}"]
    proxy, _, http_port = front_door.start_proxy(tmp_path, keys, servers, render.Limits(admin_socket=sock))
    done: dict[str, float] = {}
    try:
        readers = []
        for name, key in (("acme", KEY), ("other", OTHER)):
            conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=60)
            conn.request("GET", "/v1/stream", headers={"Authorization": f"Bearer {key}"})
            readers.append(threading.Thread(target=_read_until_cut, args=(conn, done, name), daemon=True))
            readers[-1].start()
        time.sleep(1.0)
        assert not done  # both stream
        keys.write_text(render.keys(f"other {OTHER}\n"))
        t = time.monotonic()
        assert keys_sync.sync_file(sock, keys)
        readers[0].join(timeout=5)
        assert "acme" in done and done["acme"] - t < 5  # the removed key's call is cut
        time.sleep(1.0)
        assert "other" not in done  # the other key's call runs on
        keys.write_text(render.keys(f"someone {OTHER}\n"))  # the same key, another tenant: ended too
        assert keys_sync.sync_file(sock, keys)
        readers[1].join(timeout=5)
        assert "other" in done
        many = "".join(f"t{i} {secrets.token_hex(16)}\n" for i in range(300))  # past one command's buffer
        keys.write_text(render.keys(many))
        assert keys_sync.sync_file(sock, keys)
        assert len(keys_sync._HELD.findall(keys_sync.runtime(sock, f"show map {keys}\n"))) == 300
        assert keys_sync.end_calls(sock, {"0" * 64}) == 0
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
        backend.shutdown()


class _Api(http.server.BaseHTTPRequestHandler):
    """The Kubernetes API's secrets collection, as the sidecar uses it: a list, then a watch that
    sends the events queued on the server (None ends the watch)."""

    protocol_version = "HTTP/1.1"
    server: Any

    def do_GET(self) -> None:
        self.server.seen.append((self.path, self.headers.get("Authorization")))
        if "watch=1" not in self.path:
            body = json.dumps({"metadata": {"resourceVersion": "7"}, "items": self.server.items}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while (event := self.server.events.get()) is not None:
            if event == "cut":  # the connection lost in the middle of a chunk
                self.wfile.write(b'ff\r\n{"type": "MOD')
                self.wfile.flush()
                self.close_connection = True
                return
            line = json.dumps(event).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")

    def log_message(self, *args: Any) -> None:
        pass


def _secret(text: str) -> dict[str, Any]:
    return {"metadata": {"name": "keys"}, "data": {"keys.map": base64.b64encode(text.encode()).decode()}}


def _wait_for(check: Any, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return False


def test_the_secret_is_listed_then_watched_and_its_deletion_revokes(tmp_path: Path) -> None:
    api = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    api.items, api.events, api.seen = [_secret("first\n")], queue.Queue(), []  # type: ignore[attr-defined]
    threading.Thread(target=api.serve_forever, daemon=True).start()
    (tmp_path / "token").write_text("sa-token\n")
    source = keys_sync.SecretSource("ns", "keys", "keys.map", f"http://127.0.0.1:{api.server_address[1]}",
                                    tmp_path / "token", None)  # fmt: skip
    desired, stop = keys_sync.Desired(), threading.Event()
    follower = threading.Thread(target=source.follow, args=(desired, stop), daemon=True)
    follower.start()
    try:
        assert _wait_for(lambda: desired.data == b"first\n")
        api.events.put({"type": "MODIFIED", "object": _secret("second\n")})  # type: ignore[attr-defined]
        assert _wait_for(lambda: desired.data == b"second\n")
        api.events.put({"type": "DELETED", "object": _secret("second\n")})  # type: ignore[attr-defined]
        assert _wait_for(lambda: desired.known and desired.data is None)
        api.events.put("cut")  # type: ignore[attr-defined]  # the watch breaks: listed and watched again
        assert _wait_for(lambda: sum("watch=1" in p for p, _ in api.seen) >= 2)  # type: ignore[attr-defined]
        api.items = []  # type: ignore[attr-defined]
        api.events.put({"type": "ERROR", "object": {"code": 410}})  # an expired version: listed again
        assert _wait_for(lambda: sum("watch=1" in p for p, _ in api.seen) >= 3)  # type: ignore[attr-defined]
        assert desired.data is None
        path, auth = api.seen[0]  # type: ignore[attr-defined]
        assert path.startswith("/api/v1/namespaces/ns/secrets?fieldSelector=metadata.name%3Dkeys")
        assert auth == "Bearer sa-token"
    finally:
        stop.set()
        api.events.put(None)  # type: ignore[attr-defined]
        api.shutdown()


def test_a_map_that_is_missing_or_broken_commits_an_empty_map(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[str] = []

    def runtime(path: str, command: str, timeout: float = 5.0) -> str:
        sent.append(command.split("\n")[0])
        if command.startswith("show map"):
            return f"0x1 {'a' * 64} acme\n"
        return "New version created: 3\n" if command.startswith("prepare") else ""

    monkeypatch.setattr(keys_sync, "runtime", runtime)
    for data in (None, b"not a map\n", b""):
        sent.clear()
        assert keys_sync.sync("sock", "/k.map", data, "the map")
        assert sent[:3] == ["show map /k.map", "prepare map /k.map", "commit map @3 /k.map"]
        assert sent[3] == "show table calls"  # acme's calls looked up to be ended
    sent.clear()
    assert not keys_sync.sync("sock", "/k.map", f"{'a' * 64} acme\n".encode(), "the map")  # as held: nothing
    assert sent == ["show map /k.map"]


def test_calls_left_to_end_after_a_failed_commit_are_ended_at_the_next_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The map committed, then `show table` fails (a busy proxy): the removed key's digest is kept,
    and the next sync, which finds the map already right, ends its calls then."""
    sent: list[str] = []
    held = {"map": f"0x1 {'a' * 64} acme\n", "tables": 0}

    def runtime(path: str, command: str, timeout: float = 5.0) -> str:
        sent.append(command.split("\n")[0])
        if command.startswith("show map"):
            return held["map"]
        if command.startswith("commit"):
            held["map"] = ""
        if command.startswith("show table"):
            held["tables"] += 1
            if held["tables"] == 1:
                raise TimeoutError("timed out")
            return f"0x9: key={'a' * 64}\\ 17 use=1 exp=0\n"
        if command.startswith("show sess"):
            return "0xbeef: [30/Nov/2026:03:00:00.000000] id=17 proto=tcpv4 source=127.0.0.1:1\n"
        return "New version created: 3\n" if command.startswith("prepare") else ""

    monkeypatch.setattr(keys_sync, "runtime", runtime)
    to_end: set[str] = set()
    with pytest.raises(TimeoutError):
        keys_sync.sync("sock", "/k.map", b"", "the map", to_end)
    assert to_end == {"a" * 64}
    assert not keys_sync.sync("sock", "/k.map", b"", "the map", to_end)  # the map is right: calls ended now
    assert sent[-1] == "shutdown session 0xbeef" and not to_end
