"""Render the front door's HAProxy config and key map (deploy/haproxy/haproxy.cfg.in).

    python deploy/haproxy/render.py config --keys-map /etc/haproxy/keys.map \\
        --replica 10.0.0.5:50051:8000 --replica 10.0.0.6:50051:8000 > haproxy.cfg
    python deploy/haproxy/render.py config --keys-map /etc/haproxy/keys.map \\
        --dns batchserve-headless.default.svc.cluster.local:50051:8000:8 > haproxy.cfg
    python deploy/haproxy/render.py keys api-keys.txt > keys.map

`--replica HOST:GRPC_PORT:HTTP_PORT` names one replica (loopback, VMs); `--dns NAME:GRPC:HTTP:N`
finds up to N replicas behind a DNS name (a Kubernetes headless Service), re-resolved as pods
come and go. `keys` turns a batchserve key file (`TENANT KEY` lines, KEY plain or sha256:<hex>)
into HAProxy's map of SHA-256 digests to tenants: the proxy never holds a plain key.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

TEMPLATE = Path(__file__).with_name("haproxy.cfg.in")
RESOLVERS = "\nresolvers cluster\n    parse-resolv-conf\n    hold valid 5s\n"


def _replica(spec: str) -> tuple[str, int, int]:
    host, grpc_port, http_port = spec.rsplit(":", 2)
    return host, int(grpc_port), int(http_port)


def config(keys_map: str, replicas: list[str], dns: str | None, http_bind: str, grpc_bind: str) -> str:
    """The HAProxy config for these replicas (or this DNS name), binding the two front ends."""
    if bool(replicas) == bool(dns):
        raise ValueError("name the replicas: --replica HOST:GRPC:HTTP (any number) or --dns NAME:GRPC:HTTP:N")
    if dns:
        name, grpc_port, http_port, count = dns.rsplit(":", 3)
        template = f"    server-template replica {int(count)} {name}:{{}} resolvers cluster init-addr none"
        grpc = template.format(grpc_port) + f" proto h2 check-proto h1 port {http_port}"
        http = template.format(http_port)
    else:
        parsed = [_replica(r) for r in replicas]
        grpc = "\n".join(
            f"    server r{i} {h}:{g} proto h2 check-proto h1 port {p}" for i, (h, g, p) in enumerate(parsed, 1)
        )
        http = "\n".join(f"    server r{i} {h}:{p}" for i, (h, _, p) in enumerate(parsed, 1))
    text = TEMPLATE.read_text()
    for key, value in {
        "@@HTTP_BIND@@": http_bind, "@@GRPC_BIND@@": grpc_bind, "@@KEYS_MAP@@": keys_map,
        "@@HTTP_SERVERS@@": http, "@@GRPC_SERVERS@@": grpc,
    }.items():  # fmt: skip
        text = text.replace(key, value)
    return text + (RESOLVERS if dns else "")


def keys(text: str) -> str:
    """A key file as `<sha256 hex> <tenant>` lines (batchserve's own parser checks it)."""
    from batchserve.server.keys import KeyRing

    ring = KeyRing.parse(text)
    return "".join(f"{digest.hex()} {tenant}\n" for digest, tenant in ring.entries)


def sha256_hex(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    cfg = sub.add_parser("config", help="the HAProxy config")
    cfg.add_argument("--keys-map", required=True, help="where HAProxy reads the key map")
    cfg.add_argument("--replica", action="append", default=[], help="HOST:GRPC_PORT:HTTP_PORT (repeat)")
    cfg.add_argument("--dns", help="NAME:GRPC_PORT:HTTP_PORT:MAX_REPLICAS")
    cfg.add_argument("--http-bind", default=":8080", help="the OpenAI API's address (default :8080)")
    cfg.add_argument("--grpc-bind", default=":50051", help="the gRPC API's address (default :50051)")
    key_map = sub.add_parser("keys", help="a key file as the proxy's map of digests")
    key_map.add_argument("key_file")
    args = parser.parse_args(argv)
    try:
        if args.command == "config":
            sys.stdout.write(config(args.keys_map, args.replica, args.dns, args.http_bind, args.grpc_bind))
        else:
            sys.stdout.write(keys(Path(args.key_file).read_text()))
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
