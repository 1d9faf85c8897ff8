"""API keys bound to tenants (`--api-key-file`), and the one rule both front ends take a request's
tenant by.

The file holds one `TENANT KEY` pair a line, the key given plainly or as `sha256:<hex>` (its
SHA-256, so the file need not hold the secret); blank lines and `#` comments are skipped. Only
digests are kept in memory. A presented key is hashed and compared with every entry in constant
time (`hmac.compare_digest`, no early exit), so the time of a refusal says nothing of how close
a guess was. The file is re-read on SIGHUP; a file that fails to parse leaves the keys in force.

With keys on, the tenant is the key's and nothing the client sends names another (the tenant
header and request fields are ignored); a missing or unknown key is refused before any work.
Without keys, the tenant is the header a trusted gateway sets or the request's own field
(`tenant_source`), and a header sent twice is refused: a gateway that appends its own header
instead of replacing the client's must not leave the client's in force."""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("batchserve")

TENANT_HEADER = "x-batchserve-tenant"  # HTTP header and gRPC metadata key alike
MAX_KEY_LINES = 100_000
_TENANT = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # a tenant key's alphabet (`EngineCore.check_tenant`)
_DIGEST = re.compile(r"sha256:([0-9a-fA-F]{64})")


class Unauthenticated(Exception):
    """A missing or unknown API key: HTTP 401, gRPC UNAUTHENTICATED."""


class BadTenantHeader(ValueError):
    """A tenant header sent more than once: HTTP 400, gRPC INVALID_ARGUMENT."""


@dataclass(frozen=True, slots=True)
class KeyRing:
    """Each key's SHA-256 and the tenant it stands for, in file order."""

    entries: tuple[tuple[bytes, str], ...]

    @classmethod
    def parse(cls, text: str, source: str = "the key file") -> KeyRing:
        """Raises ValueError naming the line of anything it does not take."""
        entries: list[tuple[bytes, str]] = []
        seen: set[bytes] = set()
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if number > MAX_KEY_LINES:
                raise ValueError(f"{source}: more than {MAX_KEY_LINES} lines")
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(f"{source} line {number}: expected `TENANT KEY`, got {len(parts)} fields")
            tenant, key = parts
            if not _TENANT.fullmatch(tenant):
                raise ValueError(f"{source} line {number}: a tenant is 1-128 of A-Z a-z 0-9 . _ : -")
            digest = _digest_of(key, f"{source} line {number}")
            if digest in seen:
                raise ValueError(f"{source} line {number}: this key is already given to a tenant")
            seen.add(digest)
            entries.append((digest, tenant))
        if not entries:
            raise ValueError(f"{source}: no keys (every request would be refused)")
        return cls(tuple(entries))

    def tenant_of(self, key: str) -> str | None:
        """The tenant `key` stands for, or None; every entry compared, in constant time each."""
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()
        found = None
        for stored, tenant in self.entries:
            if hmac.compare_digest(stored, digest) and found is None:
                found = tenant
        return found


def _digest_of(key: str, where: str) -> bytes:
    hashed = _DIGEST.fullmatch(key)
    if hashed:
        return bytes.fromhex(hashed.group(1))
    if key.startswith("sha256:"):
        raise ValueError(f"{where}: `sha256:` takes 64 hex digits")
    if len(key) < 16:
        raise ValueError(f"{where}: a key of {len(key)} characters is too easy to guess (at least 16)")
    return hashlib.sha256(key.encode()).digest()


class ApiKeys:
    """The server's key file: read at start (an error then stops the server), re-read by `reload`
    (SIGHUP), where an error keeps the keys in force and is logged."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.ring = self._read()

    def _read(self) -> KeyRing:
        try:
            text = self.path.read_text()
        except OSError as e:
            raise ValueError(f"api key file {self.path}: {e.strerror or e}") from None
        return KeyRing.parse(text, f"api key file {self.path}")

    def reload(self) -> bool:
        """Re-read the file; whether the new keys took effect."""
        try:
            self.ring = self._read()
        except ValueError as e:
            logger.error("keys not reloaded, the previous ones stay in force: %s", e)
            return False
        logger.info("api keys reloaded from %s: %d keys", self.path, len(self.ring.entries))
        return True

    def authenticate(self, authorization: list[str]) -> str:
        """The tenant of a request's `Authorization` values (`Bearer KEY`); Unauthenticated if
        there is not exactly one or its key is unknown."""
        if not authorization:
            raise Unauthenticated("missing API key: send `Authorization: Bearer KEY`")
        if len(authorization) > 1:
            raise Unauthenticated("more than one Authorization header")
        scheme, _, key = authorization[0].strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("the Authorization header takes `Bearer KEY`")
        tenant = self.ring.tenant_of(key.strip())
        if tenant is None:
            raise Unauthenticated("invalid API key")
        return tenant


def request_tenant(
    keys: ApiKeys | None, authorization: list[str], headers: list[str], field: str | None, source: str
) -> str:
    """A request's tenant: its key's where keys are on (Unauthenticated without a valid one),
    else `choose_tenant` of the one tenant header and the request's field (BadTenantHeader for
    a header sent twice)."""
    if keys is not None:
        return keys.authenticate(authorization)
    if len(headers) > 1:
        raise BadTenantHeader(f"{TENANT_HEADER} sent {len(headers)} times: at most once")
    return choose_tenant(source, headers[0] if headers else None, field)


def choose_tenant(source: str, header: str | None, field: str | None) -> str:
    """A request's tenant key under `source` (ServerConfig.tenant_source) without API keys: the
    header a gateway sets, the request's own field, or both with the header winning ("" for none)."""
    if source == "header":
        return header or ""
    if source == "request":
        return field or ""
    return header or field or ""
