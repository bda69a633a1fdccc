"""Who is asking: API keys, the tenant each belongs to, and the prefix-cache scope that follows.

A prefix cache is a side channel: whether a prompt was sent before shows in `cached_tokens` and in
the time to first token. So each tenant (a name in `--api-keys-file`) gets a cache of its own: the
tenant folds into the root of every request's hash chain, as `cache_salt` does, so no block,
snapshot, SSD file or KV event of one tenant is ever found by another's prompt. `cache_salt` still
divides a tenant further. `--shared-prefix-cache` opts out (every tenant finds every prefix).

The keys file holds one `KEY TENANT` per line (`#` starts a comment). It is read again on SIGHUP and
whenever its modification time or size changes (looked at, at most once a second, as requests
arrive); a file that no longer parses keeps the keys in force and logs why.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# The tenant of the request being handled, set by the key check before any route runs (None: no
# keys file, so no tenants).
CURRENT_TENANT: ContextVar[str | None] = ContextVar("v4serve_tenant", default=None)
# The tenant of `--api-key` (and its metrics label when no keys file is given).
DEFAULT_TENANT = "default"
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
# Seconds between looks at the keys file's modification time.
RECHECK_SECONDS = 1.0


class KeysFileError(ValueError):
    pass


def parse_keys(text: str, source: str = "keys file") -> dict[str, str]:
    """{key: tenant} from a keys file's text; a clear error naming the line otherwise."""
    keys: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 2:
            raise KeysFileError(f"{source} line {number}: expected 'KEY TENANT', got {len(fields)} fields")
        key, tenant = fields
        if not _TENANT_NAME.fullmatch(tenant):
            raise KeysFileError(f"{source} line {number}: tenant {tenant!r} must be 1-64 letters, digits or _.@- "
                                "(it labels metrics)")
        if key in keys:
            raise KeysFileError(f"{source} line {number}: this key is already given to tenant {keys[key]!r}")
        keys[key] = tenant
    return keys


def _digest(key: bytes) -> bytes:
    # Keys are looked up by digest: the dict lookup's timing then tells nothing about a key's bytes.
    return hashlib.sha256(key).digest()


@dataclass(frozen=True)
class _Table:
    by_digest: dict[bytes, str]
    stamp: tuple[int, int] | None  # the file's (mtime_ns, size) when read


class ApiKeys:
    """The keys the daemon accepts and their tenants: `--api-key` (tenant "default") and the keys file."""

    def __init__(self, api_key: str | None = None, keys_file: str | Path | None = None) -> None:
        self.keys_file = Path(keys_file) if keys_file else None
        self._fixed = {_digest(api_key.encode()): DEFAULT_TENANT} if api_key else {}
        self._lock = threading.Lock()
        self._next_look = 0.0
        self._table = _Table(dict(self._fixed), None)
        if self.keys_file is not None:
            self._table = self._read()  # a bad file at start is an error, not an empty table

    @property
    def tenants(self) -> frozenset[str]:
        """Every tenant a key names now (bounded by the file: metrics are labelled with them)."""
        return frozenset(self._table.by_digest.values())

    @property
    def isolating(self) -> bool:
        """Tenants exist only with a keys file; without one there is one user and nothing to divide."""
        return self.keys_file is not None

    def tenant_of(self, key: bytes) -> str | None:
        """The tenant a presented key belongs to, or None if it is no key of this daemon."""
        self._maybe_reload()
        return self._table.by_digest.get(_digest(key))

    def reload(self) -> bool:
        """Read the keys file again (SIGHUP); a file that does not parse keeps the keys in force."""
        if self.keys_file is None:
            return False
        try:
            table = self._read()
        except (OSError, KeysFileError) as exc:
            log.error("keys file %s not reloaded, the %d keys read before stay in force: %s", self.keys_file,
                      len(self._table.by_digest), exc)
            return False
        with self._lock:
            before, self._table = self._table, table
        if before.by_digest != table.by_digest:
            log.info("keys file %s reloaded: %d keys of %d tenants", self.keys_file, len(table.by_digest),
                     len(set(table.by_digest.values())))
        return True

    def _read(self) -> _Table:
        assert self.keys_file is not None
        st = os.stat(self.keys_file)
        keys = parse_keys(self.keys_file.read_text(encoding="utf-8"), str(self.keys_file))
        if not keys:
            raise KeysFileError(f"{self.keys_file} holds no keys")
        by_digest = {**self._fixed, **{_digest(k.encode()): t for k, t in keys.items()}}
        return _Table(by_digest, (st.st_mtime_ns, st.st_size))

    def _maybe_reload(self) -> None:
        now = time.monotonic()
        if self.keys_file is None or now < self._next_look:
            return
        self._next_look = now + RECHECK_SECONDS
        with contextlib.suppress(OSError):
            st = os.stat(self.keys_file)
            if (st.st_mtime_ns, st.st_size) != self._table.stamp:
                self.reload()


def scoped_salt(tenant: str | None, salt: str | None) -> str | None:
    """The salt the engine folds into a request's hash-chain root: the client's `cache_salt` within
    its tenant's scope (None: caches are shared, the salt alone divides). Under isolation every request
    has a tenant, so every salt the engine sees is of this form and no raw salt can name a tenant's
    scope."""
    return salt if tenant is None else json.dumps(["tenant", tenant, salt])
