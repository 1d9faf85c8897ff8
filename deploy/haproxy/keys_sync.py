"""Keep the front door's key map equal to its file, in place: a sidecar beside HAProxy.

    python deploy/haproxy/keys_sync.py --map /etc/haproxy/keys/keys.map \\
        --socket /var/run/haproxy/admin.sock [--every 2]

HAProxy reads its map file once, at start: a key removed from the Secret would keep working until
the proxy restarted. This polls the file (a mounted Secret is swapped whole, by a symlink) and, when
its bytes change, replaces the map HAProxy holds through its runtime API (the config's admin socket)
in one atomic step: `prepare map` (a new version), `add map @version` (the whole file as one
payload), `commit map @version`. No restart, no dropped connection. Calls already running under a
removed key run on; the replicas' own key check (--api-key-file, where it is on) ends those.

Like the replicas' key file, a map that is missing or does not parse revokes every key: an empty map
is committed, and it is logged as an error.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import re
import socket
import time
from pathlib import Path

logger = logging.getLogger("keys_sync")
_ENTRY = re.compile(r"([0-9a-f]{64}) ([A-Za-z0-9._:-]{1,128})")


def parse_map(text: str) -> list[tuple[str, str]]:
    """`<sha256 hex> <tenant>` lines (render.py's `keys`); ValueError naming the first line that is not."""
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        match = _ENTRY.fullmatch(line.strip())
        if match is None:
            raise ValueError(f"line {number}: expected `<sha256 hex> <tenant>`")
        entries.append((match.group(1), match.group(2)))
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


def replace_map(path: str, map_name: str, entries: list[tuple[str, str]]) -> None:
    """HAProxy's map `map_name` replaced by `entries` in one commit; RuntimeError if refused."""
    answer = runtime(path, f"prepare map {map_name}\n")
    version = re.search(r"New version created: (\d+)", answer)
    if version is None:
        raise RuntimeError(f"prepare map {map_name}: {answer.strip()}")
    if entries:
        payload = "".join(f"{key} {tenant}\n" for key, tenant in entries)
        answer = runtime(path, f"add map @{version.group(1)} {map_name} <<\n{payload}\n")
        if answer.strip():
            raise RuntimeError(f"add map: {answer.strip()}")
    answer = runtime(path, f"commit map @{version.group(1)} {map_name}\n")
    if answer.strip():
        raise RuntimeError(f"commit map: {answer.strip()}")


def sync_once(path: str, map_file: Path, last: str | None) -> str:
    """The map file's digest; HAProxy's map replaced where it differs from `last`. A file that
    is missing or does not parse commits an empty map (every key revoked)."""
    try:
        data = map_file.read_bytes()
    except OSError as e:
        data, error = b"", f"{map_file}: {e.strerror or e}"
    else:
        error = None
    digest = hashlib.sha256(data if error is None else b"\0missing").hexdigest()
    if digest == last:
        return digest
    try:
        entries = [] if error is not None else parse_map(data.decode("utf-8", "replace"))
    except ValueError as e:
        entries, error = [], f"{map_file} {e}"
    replace_map(path, str(map_file), entries)
    if error is not None or not entries:
        logger.error("every key revoked at the proxy: %s", error or f"{map_file} holds no keys")
    else:
        logger.info("key map reloaded: %d keys", len(entries))
    return digest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--map", type=Path, required=True, help="the key map file, as the HAProxy config names it")
    parser.add_argument("--socket", required=True, help="HAProxy's admin socket (render.py --admin-socket)")
    parser.add_argument("--every", type=float, default=2.0, help="seconds between looks at the file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    last: str | None = None
    while True:
        try:
            last = sync_once(args.socket, args.map, last)
        except (OSError, RuntimeError) as e:  # HAProxy not up yet, or restarting: try again
            logger.warning("key map not synced yet: %s", e)
        time.sleep(args.every)


if __name__ == "__main__":
    raise SystemExit(main())
