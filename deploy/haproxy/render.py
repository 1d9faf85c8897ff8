"""Render the front door's HAProxy config and key map (deploy/haproxy/haproxy.cfg.in).

    python deploy/haproxy/render.py config --keys-map /etc/haproxy/keys.map \\
        --replica 10.0.0.5:50051:8000 --replica 10.0.0.6:50051:8000 > haproxy.cfg
    python deploy/haproxy/render.py config --keys-map /etc/haproxy/keys.map \\
        --dns batchserve-headless.default.svc.cluster.local:50051:8000:8 > haproxy.cfg
    python deploy/haproxy/render.py keys api-keys.txt > keys.map

With `--replica-ca CA.pem [--replica-client-cert PROXY.pem]` the proxy talks TLS to the replicas
(and presents its certificate where they run with --tls-client-ca: mTLS).

`--replica HOST:GRPC_PORT:HTTP_PORT` names one replica (loopback, VMs); `--dns NAME:GRPC:HTTP:N`
finds up to N replicas behind a DNS name (a Kubernetes headless Service), re-resolved as pods
come and go. `keys` turns a batchserve key file (`TENANT KEY` lines, KEY plain or sha256:<hex>)
into HAProxy's map of SHA-256 digests to tenants: the proxy never holds a plain key.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

TEMPLATE = Path(__file__).with_name("haproxy.cfg.in")
RESOLVERS = "\nresolvers cluster\n    parse-resolv-conf\n    hold valid 5s\n"


def _replica(spec: str) -> tuple[str, int, int]:
    host, grpc_port, http_port = spec.rsplit(":", 2)
    return host, int(grpc_port), int(http_port)


@dataclass(frozen=True, slots=True)
class Limits:
    """What holds per client address before a key is looked at, and where the admin socket is."""

    conn_per_source: int = 64  # open connections
    rate_per_source: int = 1000  # requests (gRPC: calls) a 10 s window
    admin_socket: str = "/var/run/haproxy/admin.sock"  # the runtime API: keys_sync.py reloads the map there
    request_seconds: int = 10  # a request's head and body must arrive within this


def _tls(tls: tuple[str, str | None] | None, h2: bool) -> str:
    """A server line's TLS to the replica: verified against the CA, with the proxy's client
    certificate where one is given (mTLS: replicas run with --tls-client-ca)."""
    if tls is None:
        return ""
    ca, client = tls
    line = f" ssl verify required ca-file {ca}" + (f" crt {client}" if client else "")
    return line + (" alpn h2 check-ssl" if h2 else "")


def config(
    keys_map: str,
    replicas: list[str],
    dns: str | None,
    http_bind: str,
    grpc_bind: str,
    limits: Limits = Limits(),
    tls: tuple[str, str | None] | None = None,
) -> str:
    """The HAProxy config for these replicas (or this DNS name), binding the two front ends.
    `tls`: (CA file, client certificate PEM or None): the proxy talks TLS to the replicas."""
    if bool(replicas) == bool(dns):
        raise ValueError("name the replicas: --replica HOST:GRPC:HTTP (any number) or --dns NAME:GRPC:HTTP:N")
    if dns:
        name, grpc_port, http_port, count = dns.rsplit(":", 3)
        template = f"    server-template replica {int(count)} {name}:{{}} resolvers cluster init-addr none"
        grpc = template.format(grpc_port) + f" proto h2 check-proto h1 port {http_port}" + _tls(tls, True)
        http = template.format(http_port) + _tls(tls, False)
    else:
        parsed = [_replica(r) for r in replicas]
        grpc = "\n".join(
            f"    server r{i} {h}:{g} proto h2 check-proto h1 port {p}{_tls(tls, True)}"
            for i, (h, g, p) in enumerate(parsed, 1)
        )
        http = "\n".join(f"    server r{i} {h}:{p}{_tls(tls, False)}" for i, (h, _, p) in enumerate(parsed, 1))
    text = TEMPLATE.read_text()
    for key, value in {
        "@@HTTP_BIND@@": http_bind, "@@GRPC_BIND@@": grpc_bind, "@@KEYS_MAP@@": keys_map,
        "@@HTTP_SERVERS@@": http, "@@GRPC_SERVERS@@": grpc, "@@ADMIN_SOCKET@@": limits.admin_socket,
        "@@CONN_PER_SOURCE@@": str(limits.conn_per_source), "@@RATE_PER_SOURCE@@": str(limits.rate_per_source),
        "@@REQUEST_SECONDS@@": str(limits.request_seconds),
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
    cfg.add_argument("--admin-socket", default=Limits.admin_socket, help="the runtime API's socket (keys_sync.py)")
    cfg.add_argument("--conn-per-source", type=int, default=Limits.conn_per_source, help="connections per address")
    cfg.add_argument("--rate-per-source", type=int, default=Limits.rate_per_source, help="requests per address, 10 s")
    cfg.add_argument("--replica-ca", help="talk TLS to the replicas, verified against this CA file")
    cfg.add_argument("--replica-client-cert", help="the proxy's certificate and key (PEM) for replicas' mTLS")
    key_map = sub.add_parser("keys", help="a key file as the proxy's map of digests")
    key_map.add_argument("key_file")
    args = parser.parse_args(argv)
    try:
        if args.command == "config":
            limits = Limits(args.conn_per_source, args.rate_per_source, args.admin_socket)
            tls = (args.replica_ca, args.replica_client_cert) if args.replica_ca else None
            if args.replica_client_cert and not args.replica_ca:
                raise ValueError("--replica-client-cert needs --replica-ca")
            sys.stdout.write(config(args.keys_map, args.replica, args.dns, args.http_bind, args.grpc_bind, limits, tls))
        else:
            sys.stdout.write(keys(Path(args.key_file).read_text()))
    except ValueError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
