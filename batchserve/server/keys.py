"""API keys bound to tenants (`--api-key-file`), and the one rule both front ends take a request's
tenant by.

The file holds one `TENANT KEY` pair a line, the key given plainly or as `sha256:<hex>` (its
SHA-256, so the file need not hold the secret); blank lines and `#` comments are skipped. Only
digests are kept in memory. A presented key is hashed and compared with every entry in constant
time (`hmac.compare_digest`, no early exit), so the time of a refusal says nothing of how close
a guess was. A plain key must hold 128 bits or more by its alphabet (`key_bits`): 32 hex digits,
22 base64 characters, 20 of any printable ASCII.

The file is re-read on SIGHUP, and a reload fails closed: a file that is missing, empty or does
not parse revokes every key (each call gets 401 / UNAUTHENTICATED until a good file is read), so
that no removed key outlives its removal because the new file was broken; write it whole (a
rename) before the signal. The calls running under a key that is gone, or now names another
tenant, end at the reload (`live`). A file that others than its owner may read or write is
warned of in the log.

With keys on, the tenant is the key's and nothing the client sends names another (the tenant
header and request fields are ignored); a missing or unknown key is refused before any work.
Without keys, the tenant is the header a trusted gateway sets or the request's own field
(`tenant_source`), and a header sent twice is refused: a gateway that appends its own header
instead of replacing the client's must not leave the client's in force."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import math
import re
import stat
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

logger = logging.getLogger("batchserve")
T = TypeVar("T")

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
        return self.tenant_of_digest(hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest())

    def tenant_of_digest(self, digest: bytes) -> str | None:
        """The tenant of the key whose SHA-256 is `digest` (`tenant_of`)."""
        found = None
        for stored, tenant in self.entries:
            if hmac.compare_digest(stored, digest) and found is None:
                found = tenant
        return found


MIN_KEY_BITS = 128
_HEX = frozenset("0123456789abcdefABCDEF")
_BASE64 = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_+/=")


def key_bits(key: str) -> float:
    """What a random key of this length from its alphabet holds: hex digits 4 bits each, base64's
    6, any printable ASCII 6.55. A key with fewer than 8 distinct characters counts as none."""
    if len(set(key)) < 8:
        return 0.0
    chars = set(key)
    per_char = 4.0 if chars <= _HEX else 6.0 if chars <= _BASE64 else math.log2(94)
    return len(key) * per_char


def _digest_of(key: str, where: str) -> bytes:
    hashed = _DIGEST.fullmatch(key)
    if hashed:
        return bytes.fromhex(hashed.group(1))
    if key.startswith("sha256:"):
        raise ValueError(f"{where}: `sha256:` takes 64 hex digits")
    if key_bits(key) < MIN_KEY_BITS:
        raise ValueError(
            f"{where}: a key of {key_bits(key):.0f} bits is too easy to guess (at least {MIN_KEY_BITS}: 32 hex"
            " digits, 22 base64 characters; `openssl rand -hex 32` makes one)"
        )
    return hashlib.sha256(key.encode()).digest()


def read_secret_file(path: Path, what: str) -> str:
    """A file holding a secret: its text (ValueError naming the file where it cannot be read), and a
    warning in the log where anyone but its owner may read or write it."""
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {path}: {getattr(e, 'strerror', None) or e}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("%s %s is open to others (mode %o): chmod 600 it", what, path, stat.S_IMODE(mode))
    return text


class Revoked(Exception):
    """The call's key was removed from the file, or given to another tenant, while the call ran."""


class KeyedCall:
    """One call under a key: what it awaits through `run` is a task that `end` (a reload that
    removed the key) cancels, and `run` then raises Revoked instead of CancelledError."""

    def __init__(self) -> None:
        self.revoked = False
        self._task: asyncio.Future[Any] | None = None

    def end(self) -> None:
        self.revoked = True
        if self._task is not None:
            self._task.cancel()

    async def run(self, step: Awaitable[T]) -> T:
        if self.revoked:
            raise Revoked("the call's API key was revoked")
        self._task = task = asyncio.ensure_future(step)
        try:
            return await task  # the caller cancelled: so is the task
        except asyncio.CancelledError:
            if self.revoked:
                raise Revoked("the call's API key was revoked") from None
            raise
        finally:
            self._task = None


class ApiKeys:
    """The server's key file: read at start (an error then stops the server), re-read by `reload`
    (SIGHUP), which fails closed; the calls running under each key (`live`)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.ring: KeyRing | None = self._read()
        self._live: dict[bytes, dict[int, tuple[str, Callable[[], object]]]] = {}  # digest -> call -> (tenant, end)

    def _read(self) -> KeyRing:
        return KeyRing.parse(read_secret_file(self.path, "api key file"), f"api key file {self.path}")

    def reload(self) -> bool:
        """Re-read the file; whether it took. One that cannot be read or parsed revokes every key.
        Then every call whose key is gone or names another tenant now is ended."""
        try:
            self.ring = self._read()
        except ValueError as e:
            self.ring = None
            logger.error("api keys revoked, every call is refused until the file reads: %s", e)
        else:
            logger.info("api keys reloaded from %s: %d keys", self.path, len(self.ring.entries))
        ended = 0
        for digest, calls in list(self._live.items()):
            tenant = self.ring.tenant_of_digest(digest) if self.ring is not None else None
            for tenant_then, end in list(calls.values()):
                if tenant != tenant_then:
                    end()
                    ended += 1
        if ended:
            logger.warning("%d calls under removed or changed keys ended", ended)
        return self.ring is not None

    def identify(self, authorization: list[str]) -> tuple[str, bytes]:
        """The tenant of a request's `Authorization` values (`Bearer KEY`) and its key's digest;
        Unauthenticated if there is not exactly one or its key is unknown."""
        if not authorization:
            raise Unauthenticated("missing API key: send `Authorization: Bearer KEY`")
        if len(authorization) > 1:
            raise Unauthenticated("more than one Authorization header")
        scheme, _, key = authorization[0].strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthenticated("the Authorization header takes `Bearer KEY`")
        digest = hashlib.sha256(key.strip().encode("utf-8", "surrogatepass")).digest()
        tenant = self.ring.tenant_of_digest(digest) if self.ring is not None else None
        if tenant is None:
            raise Unauthenticated("invalid API key")
        return tenant, digest

    def authenticate(self, authorization: list[str]) -> str:
        """The tenant of a request's `Authorization` values (`identify`)."""
        return self.identify(authorization)[0]

    @contextmanager
    def live(self, authorization: list[str], end: Callable[[], object]) -> Iterator[str]:
        """A call under the key of `authorization` while the block runs (its tenant given):
        `end()` is called if a reload removes the key or gives it to another tenant."""
        tenant, digest = self.identify(authorization)
        calls = self._live.setdefault(digest, {})
        calls[id(end)] = (tenant, end)
        try:
            yield tenant
        finally:
            calls.pop(id(end), None)
            if not calls:
                self._live.pop(digest, None)


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
