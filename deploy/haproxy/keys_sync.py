"""Keep the front door's key map equal to its source, in place, and end the calls of removed keys:
a sidecar beside HAProxy (standard library only: it ships as one file in a ConfigMap).

    python deploy/haproxy/keys_sync.py --socket /var/run/haproxy/admin.sock \\
        --map /etc/haproxy/keys/keys.map [--secret NAMESPACE/NAME] [--every 2]

HAProxy reads its map file once, at start: a key removed from the Secret would keep working until
the proxy restarted. The sidecar takes the map's text from one of two sources:

- `--map` alone: the mounted file, looked at every `--every` seconds. The kubelet swaps a mounted
  Secret within its sync period (about a minute by default), so a removal takes that long.
- `--secret NAMESPACE/NAME`: the Secret itself, watched through the Kubernetes API (the pod's
  service account needs get/list/watch on it): a change is seen within a second. `--map` is still
  the map's name in HAProxy's config.

When the text differs from the map HAProxy holds (`show map`), the map is replaced through the
runtime API (the config's admin socket) in one atomic step: `prepare map` (a new version), `add map
@version` (the whole text as one payload), `commit map @version`. No restart, no dropped connection.
Then every call still running under a key that is gone, or that now names another tenant, is ended:
the config tracks each call as `<key digest> <call id>` in the `calls` table, and each such call's
stream is shut down (HTTP: the connection cut; gRPC: that stream reset). The map is checked against
HAProxy's again every `--resync` seconds, so a restarted proxy (which reads the older mounted file)
is corrected too.

Like the replicas' key file, a map that is missing or does not parse revokes every key: an empty map
is committed, and it is logged as an error.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import re
import socket
import ssl
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger("keys_sync")
_ENTRY = re.compile(r"([0-9a-f]{64}) ([A-Za-z0-9._:-]{1,128})")
_HELD = re.compile(r"^0x[0-9a-f]+ ([0-9a-f]{64}) (\S+)$", re.M)  # `show map` lines
_CALL = re.compile(r"key=([0-9a-f]{64})\\? (\d+) ")  # `show table calls` lines: the key's digest, the call's id
_STREAM = re.compile(r"^(0x[0-9a-f]+): \[[^\]]*\] id=(\d+) ", re.M)  # `show sess all`: stream pointer, call id
CALLS_TABLE = "calls"  # haproxy.cfg.in's table of running calls
ADD_AT_ONCE = 50  # map entries a runtime API command (about 200 bytes each at most)
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def parse_map(text: str) -> dict[str, str]:
    """`<sha256 hex> <tenant>` lines (render.py's `keys`); ValueError naming the first line that is not."""
    entries = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _ENTRY.fullmatch(line.strip())
        if match is None:
            raise ValueError(f"line {number}: expected `<sha256 hex> <tenant>`")
        entries[match.group(1)] = match.group(2)
    return entries


def runtime(path: str, command: str, timeout: float = 5.0) -> str:
    """One command on HAProxy's runtime API at the unix socket `path`, and its whole answer."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(path)
        sock.sendall(command.encode())
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer.decode()


def replace_map(path: str, map_name: str, entries: dict[str, str]) -> None:
    """HAProxy's map `map_name` replaced by `entries` in one commit; RuntimeError if refused."""
    answer = runtime(path, f"prepare map {map_name}\n")
    version = re.search(r"New version created: (\d+)", answer)
    if version is None:
        raise RuntimeError(f"prepare map {map_name}: {answer.strip()}")
    lines = [f"{key} {tenant}\n" for key, tenant in entries.items()]
    for i in range(0, len(lines), ADD_AT_ONCE):  # a payload fits the CLI's buffer (tune.bufsize, 16 KiB)
        payload = "".join(lines[i : i + ADD_AT_ONCE])
        answer = runtime(path, f"add map @{version.group(1)} {map_name} <<\n{payload}\n")
        if answer.strip():
            raise RuntimeError(f"add map: {answer.strip()}")
    answer = runtime(path, f"commit map @{version.group(1)} {map_name}\n")
    if answer.strip():
        raise RuntimeError(f"commit map: {answer.strip()}")


def end_calls(path: str, digests: set[str]) -> int:
    """Every running call under one of `digests` (key SHA-256s) shut down; how many were."""
    if not digests:
        return 0
    ids = {call for digest, call in _CALL.findall(runtime(path, f"show table {CALLS_TABLE}\n")) if digest in digests}
    streams = [pointer for pointer, call in _STREAM.findall(runtime(path, "show sess all\n")) if call in ids]
    for pointer in streams:  # a call that ended meanwhile: HAProxy answers that it found none, harmlessly
        runtime(path, f"shutdown session {pointer}\n")
    return len(streams)


def sync(path: str, map_name: str, data: bytes | None, source: str, to_end: set[str] | None = None) -> bool:
    """HAProxy's map made equal to `data` (None: missing) and the calls of keys it no longer
    holds, or holds for another tenant, ended. A source that does not parse commits an empty
    map (every key revoked). `to_end`: digests whose calls are still to be ended, kept across
    calls (an error after the commit leaves them there, and the next sync ends them). Whether
    the map changed."""
    to_end = set() if to_end is None else to_end
    try:
        entries = parse_map(data.decode("utf-8", "replace")) if data is not None else None
        error = None if entries is not None else f"{source} is missing"
    except ValueError as e:
        entries, error = None, f"{source} {e}"
    wanted = entries or {}
    held = dict(_HELD.findall(runtime(path, f"show map {map_name}\n")))
    if held == wanted:
        if to_end:
            end_calls(path, to_end)
            to_end.clear()
        return False
    replace_map(path, map_name, wanted)
    to_end |= {digest for digest, tenant in held.items() if wanted.get(digest) != tenant}
    ended = end_calls(path, to_end)
    to_end.clear()
    if error is not None or not wanted:
        logger.error("every key revoked at the proxy: %s", error or f"{source} holds no keys")
    else:
        logger.info("key map reloaded: %d keys", len(wanted))
    if ended:
        logger.info("ended %d calls under removed keys", ended)
    return True


def read_file(map_file: Path) -> bytes | None:
    """The map file's bytes, or None where it is missing or unreadable."""
    try:
        return map_file.read_bytes()
    except OSError:
        return None


def sync_file(path: str, map_file: Path) -> bool:
    """`sync` from the map file itself (its name in HAProxy's config)."""
    return sync(path, str(map_file), read_file(map_file), str(map_file))


@dataclass
class Desired:
    """The latest text of the map's source, and a wakeup when it changes (the Secret's watcher)."""

    data: bytes | None = None
    known: bool = False  # whether any version has been read yet (before it, nothing is committed)
    changed: threading.Event = field(default_factory=threading.Event)

    def set(self, data: bytes | None, wake: bool = True) -> None:
        self.data, self.known = data, True
        if wake:
            self.changed.set()


@dataclass(frozen=True)
class SecretSource:
    """A Secret's entry read and watched through the Kubernetes API (in-cluster by default)."""

    namespace: str
    name: str
    entry: str  # the file name inside the Secret: keys.map
    api: str = ""  # https://host:port; default: the in-cluster service's address
    token_file: Path = SERVICE_ACCOUNT / "token"
    ca_file: Path | None = SERVICE_ACCOUNT / "ca.crt"

    def _open(self, query: dict[str, str], timeout: float) -> object:
        api = self.api or f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
        url = f"{api}/api/v1/namespaces/{self.namespace}/secrets?{urllib.parse.urlencode(query)}"
        token = self.token_file.read_text().strip()  # read each time: the kubelet rotates it
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
        context = None
        if self.ca_file and api.startswith("https"):
            context = ssl.create_default_context(cafile=str(self.ca_file))
        return urllib.request.urlopen(request, timeout=timeout, context=context)

    def _data(self, secret: dict | None) -> bytes | None:
        value = ((secret or {}).get("data") or {}).get(self.entry)
        return None if value is None else base64.b64decode(value)

    def follow(self, desired: Desired, stop: threading.Event, watch_seconds: int = 300) -> None:
        """List the Secret, then watch it from that version; again after any break (a watch the
        server ends, an expired version, the network). Each version goes to `desired`."""
        selector = {"fieldSelector": f"metadata.name={self.name}"}
        while not stop.is_set():
            try:
                with self._open(selector, timeout=10) as answer:  # type: ignore[attr-defined]
                    listed = json.load(answer)
                items = listed.get("items") or []
                desired.set(self._data(items[0] if items else None))
                version = listed["metadata"]["resourceVersion"]
                query = selector | {"watch": "1", "resourceVersion": version, "timeoutSeconds": str(watch_seconds)}
                with self._open(query, timeout=watch_seconds + 30) as events:  # type: ignore[attr-defined]
                    for line in events:
                        event = json.loads(line)
                        if event.get("type") == "ERROR":  # e.g. 410 Gone: the version expired; list again
                            break
                        deleted = event.get("type") == "DELETED"
                        desired.set(None if deleted else self._data(event.get("object")))
            except Exception as e:  # a watch cut mid-chunk (IncompleteRead) too: the thread must go on
                logger.warning("watching secret %s/%s: %s: %s", self.namespace, self.name, type(e).__name__, e)
                stop.wait(2.0)


def run(sock: str, map_file: Path, secret: SecretSource | None, every: float, resync: float) -> None:
    """Forever: the map synced from its source when it changes, and from HAProxy's side every `resync` s."""
    desired, stop = Desired(), threading.Event()
    if secret is not None:
        threading.Thread(target=secret.follow, args=(desired, stop), daemon=True, name="secret-watch").start()
    source = f"secret {secret.namespace}/{secret.name}" if secret else str(map_file)
    last_data, last_sync, to_end = b"\0never", 0.0, set[str]()
    while True:
        if secret is None:
            desired.set(read_file(map_file), wake=False)
        due = time.monotonic() - last_sync >= resync
        if desired.known and (desired.data != last_data or due or to_end):
            try:
                data = desired.data
                sync(sock, str(map_file), data, source, to_end)
                last_data, last_sync = data, time.monotonic()
            except (OSError, RuntimeError) as e:  # HAProxy not up yet, or restarting: try again
                logger.warning("key map not synced yet: %s", e)
        desired.changed.wait(every)
        desired.changed.clear()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--map", type=Path, required=True, help="the key map file, as the HAProxy config names it")
    parser.add_argument("--socket", required=True, help="HAProxy's admin socket (render.py --admin-socket)")
    parser.add_argument("--secret", help="NAMESPACE/NAME: watch this Secret through the Kubernetes API")
    parser.add_argument("--secret-entry", default="keys.map", help="the map's file name inside the Secret")
    parser.add_argument("--api", default="", help="the Kubernetes API's URL (default: in-cluster)")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between looks at the file")
    parser.add_argument("--resync", type=float, default=30.0, help="seconds between checks of HAProxy's own map")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    secret = None
    if args.secret:
        namespace, _, name = args.secret.partition("/")
        if not namespace or not name:
            parser.error("--secret takes NAMESPACE/NAME")
        secret = SecretSource(namespace, name, args.secret_entry, args.api)
    run(args.socket, args.map, secret, args.every, args.resync)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
