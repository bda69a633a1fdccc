"""Who is asking: API keys, the tenant each belongs to, and the prefix-cache scope that follows.

A prefix cache is a side channel: whether a prompt was sent before shows in `cached_tokens` and in
the time to first token. So each tenant (a name in `--api-keys-file`) gets a cache of its own: the
tenant folds into the root of every request's hash chain, as `cache_salt` does, so no block,
snapshot, SSD file or KV event of one tenant is ever found by another's prompt. `cache_salt` still
divides a tenant further. `--shared-prefix-cache` opts out (every tenant finds every prefix).

The keys file holds one `KEY TENANT` per line (`#` starts a comment), read as bytes: a comment in any
encoding is fine, a key is printable ASCII (what an HTTP header carries), a tenant a short name. A
watcher thread reads it again whenever its modification time or size changes (and on SIGHUP), never a
request: a request only looks a key up in the table in force. A file that no longer parses, has grown
past `MAX_KEYS_FILE_BYTES`, has gone or is not a regular file (a FIFO, a socket, a device: opened
without blocking, refused) keeps the keys in force, and says why once per change.

A file caught mid-write is never loaded: one whose last line has no newline may end inside a key or a
tenant's name (`sk-globex-1 glob`, a prefix of another tenant's scope), so it is read only once it has
not changed for `SETTLE_SECONDS`; a file that ends with a newline is whole and read at once (end it
with one, as editors and `echo` do, and a change applies within `RECHECK_SECONDS`).

`caller` is the one place that decides who a request is, from its headers: authentication, the tenant,
the owner of a stored response and the metrics' tenant label all take its answer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# The tenant of the request being handled, set by the key check before any route runs (None: no
# keys file, so no tenants).
CURRENT_TENANT: ContextVar[str | None] = ContextVar("v4serve_tenant", default=None)
# Who the request being handled is (`caller`), set before any route runs.
CURRENT_CALLER: ContextVar[Caller] = ContextVar("v4serve_caller")
# The tenant of `--api-key` (and its metrics label when no keys file is given).
DEFAULT_TENANT = "default"
_TENANT_NAME = re.compile(rb"[A-Za-z0-9][A-Za-z0-9_.@-]{0,63}")
_KEY = re.compile(rb"[\x21-\x7e]{1,512}")  # visible ASCII: what a header value can carry unchanged
# Seconds between the watcher's looks at the keys file's modification time and size.
RECHECK_SECONDS = 1.0
# A keys file larger than this is refused (keys in force kept): a million 16-byte keys fit in it.
MAX_KEYS_FILE_BYTES = 32 << 20
# Seconds a keys file that does not end with a newline must stay unchanged before it is read.
SETTLE_SECONDS = 10.0


class KeysFileError(ValueError):
    pass


class TornKeysFile(KeysFileError):
    """The file's last line has no newline: it may be a write caught halfway."""


class CredentialsError(ValueError):
    """A request's credentials that cannot be one caller: two keys that disagree, or one that is not a key."""


def parse_keys(data: bytes | str, source: str = "keys file") -> dict[bytes, str]:
    """{key: tenant} from a keys file's bytes; a clear error naming the line otherwise (never a key's
    bytes: the message may reach a log that more people read than the file)."""
    raw = data.encode() if isinstance(data, str) else data
    keys: dict[bytes, str] = {}
    for number, line in enumerate(raw.splitlines(), 1):
        fields = line.split(b"#", 1)[0].split()
        if not fields:
            continue
        if len(fields) != 2:
            raise KeysFileError(f"{source} line {number}: expected 'KEY TENANT', got {len(fields)} fields")
        key, tenant = fields
        if not _KEY.fullmatch(key):
            raise KeysFileError(f"{source} line {number}: a key must be 1-512 visible ASCII characters")
        if not _TENANT_NAME.fullmatch(tenant):
            shown = tenant[:64].decode("ascii", "replace")
            raise KeysFileError(f"{source} line {number}: tenant {shown!r} must be 1-64 letters, digits or _.@- "
                                "(it labels metrics)")
        if key in keys:
            raise KeysFileError(f"{source} line {number}: this key is already given to tenant {keys[key]!r}")
        keys[key] = tenant.decode()
    return keys


def digest(key: bytes) -> bytes:
    # Keys are looked up by digest: the dict lookup's timing then tells nothing about a key's bytes.
    return hashlib.sha256(key).digest()


@dataclass(frozen=True)
class _Table:
    by_digest: dict[bytes, str]
    stamp: tuple[int, int] | str | None  # the file's (mtime_ns, size) when read


class ApiKeys:
    """The keys the daemon accepts and their tenants: `--api-key` (tenant "default") and the keys file."""

    def __init__(self, api_key: str | None = None, keys_file: str | Path | None = None) -> None:
        self.keys_file = Path(keys_file) if keys_file else None
        self._fixed = {digest(api_key.encode()): DEFAULT_TENANT} if api_key else {}
        self._lock = threading.Lock()
        self._table = _Table(dict(self._fixed), None)
        self._refused: tuple[int, int] | str | None = None  # the stamp of a file found bad (said once), or MISSING
        self._torn: tuple[int, int] | str | None = None  # the stamp of a file caught mid-write (said once)
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        if self.keys_file is not None:
            self._table = self._first_read()

    @property
    def tenants(self) -> frozenset[str]:
        """Every tenant a key names now (bounded by the file: metrics are labelled with them)."""
        return frozenset(self._table.by_digest.values())

    @property
    def isolating(self) -> bool:
        """Tenants exist only with a keys file; without one there is one user and nothing to divide."""
        return self.keys_file is not None

    def tenant_of(self, key: bytes) -> str | None:
        """The tenant a presented key belongs to, or None if it is no key of this daemon (a lookup only:
        the file is read by the watcher)."""
        return self._table.by_digest.get(digest(key))

    def watch(self) -> None:
        """Start the thread that reads the keys file again when it changes (once serving)."""
        if self.keys_file is None or self._watcher is not None:
            return
        self._watcher = threading.Thread(target=self._watch, name="v4serve-keys", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        """Stop the watcher (without waiting for it: a read it is in cannot hold up shutdown)."""
        self._stop.set()

    def _first_read(self) -> _Table:
        """The file at start: a bad one is an error, not an empty table; one caught mid-write is waited for
        (until it ends with a newline, or has stayed as it is for SETTLE_SECONDS)."""
        assert self.keys_file is not None
        stamp, since, said = _stamp(self.keys_file), time.monotonic(), False
        while True:
            try:
                return self._read(stamp if time.monotonic() - since >= SETTLE_SECONDS else None)
            except TornKeysFile as exc:
                if not said:
                    log.warning("%s (waited for before serving)", exc)
                    said = True
            time.sleep(RECHECK_SECONDS / 4)
            now = _stamp(self.keys_file)
            if now != stamp:
                stamp, since = now, time.monotonic()

    def reload(self, settled: tuple[int, int] | str | None = None) -> bool:
        """Read the keys file again (SIGHUP, or a change); a file that does not parse keeps the keys in
        force. `settled`: the stamp the file has kept for SETTLE_SECONDS (read with that stamp, a torn last
        line is taken as the file's own)."""
        if self.keys_file is None:
            return False
        try:
            table = self._read(settled)
        except TornKeysFile as exc:
            stamp = _stamp(self.keys_file)
            if stamp != self._torn:
                self._torn = stamp
                log.warning("%s", exc)
            return False
        except (OSError, KeysFileError) as exc:
            stamp = _stamp(self.keys_file)
            if stamp != self._refused:
                self._refused = stamp
                why = exc.strerror or str(exc) if isinstance(exc, OSError) else str(exc)
                log.error("keys file %s not reloaded, the %d keys read before stay in force: %s", self.keys_file,
                          len(self._table.by_digest), why)
            return False
        self._refused = self._torn = None
        with self._lock:
            before, self._table = self._table, table
        if before.by_digest != table.by_digest:
            log.info("keys file %s reloaded: %d keys of %d tenants", self.keys_file, len(table.by_digest),
                     len(set(table.by_digest.values())))
        return True

    def _read(self, settled: tuple[int, int] | str | None) -> _Table:
        assert self.keys_file is not None
        # Non-blocking, so a FIFO put at the path cannot hold the open (or the watcher) forever.
        fd = os.open(self.keys_file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        with open(fd, "rb") as file:
            st = os.fstat(file.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise KeysFileError(f"{self.keys_file} is not a regular file (a FIFO, socket or device)")
            if st.st_size > MAX_KEYS_FILE_BYTES:
                raise KeysFileError(f"{self.keys_file} is {st.st_size} bytes, more than a keys file may be "
                                    f"({MAX_KEYS_FILE_BYTES})")
            data = file.read(MAX_KEYS_FILE_BYTES + 1)
        if len(data) > MAX_KEYS_FILE_BYTES:  # grew while read
            raise KeysFileError(f"{self.keys_file} is more than a keys file may be ({MAX_KEYS_FILE_BYTES} bytes)")
        if data and not data.endswith((b"\n", b"\r")) and settled != (st.st_mtime_ns, st.st_size):
            raise TornKeysFile(f"keys file {self.keys_file} ends inside a line (a write in progress?): read once it "
                               f"has not changed for {SETTLE_SECONDS:g} s; end it with a newline to have it read "
                               "at once")
        keys = parse_keys(data, str(self.keys_file))
        if not keys:
            raise KeysFileError(f"{self.keys_file} holds no keys")
        by_digest = {**self._fixed, **{digest(k): t for k, t in keys.items()}}
        return _Table(by_digest, (st.st_mtime_ns, st.st_size))

    def _watch(self) -> None:
        assert self.keys_file is not None
        changed_at: dict[object, float] = {}  # the stamp seen last, and since when
        while not self._stop.wait(RECHECK_SECONDS):
            stamp = _stamp(self.keys_file)
            if stamp == self._table.stamp or stamp == self._refused:
                continue
            since = changed_at.setdefault(stamp, time.monotonic())
            if len(changed_at) > 1:
                changed_at = {stamp: since}
            self.reload(settled=stamp if time.monotonic() - since >= SETTLE_SECONDS else None)


MISSING = "missing"  # the stamp of a keys file that cannot be looked at (gone, or not ours to read)


def _stamp(path: Path) -> tuple[int, int] | str:
    try:
        st = os.stat(path)
    except OSError:
        return MISSING
    return st.st_mtime_ns, st.st_size


@dataclass(frozen=True)
class Caller:
    """Who a request is: the key it presented (None: none) and, when the daemon asks for keys, that
    key's tenant (None: not a key of this daemon)."""

    key: bytes | None
    tenant: str | None = None

    @property
    def owner(self) -> str:
        """Who owns what this caller stores (a stored response): a digest of its key."""
        return hashlib.sha256(self.key or b"").hexdigest()


def presented_key(headers: Iterable[tuple[bytes, bytes]], strict: bool = True) -> bytes | None:
    """The one key a request presents, in `Authorization: Bearer KEY` (the scheme in any case, as RFC
    7235 has it) or Anthropic's `x-api-key: KEY`, however many such headers it sends; None when it
    sends none. Two that differ are a CredentialsError (which one counted would otherwise depend on
    the reader), and so, when `strict`, is an Authorization that is not a bearer key (not `strict`: it
    is no key)."""
    keys: set[bytes] = set()
    for name, value in headers:
        name = name.lower()
        if name == b"authorization":
            scheme, _, given = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and given.strip():
                keys.add(given.strip())
            elif strict:
                raise CredentialsError("the Authorization header must be 'Bearer KEY'")
        elif name == b"x-api-key":
            keys.add(value.strip())
    if len(keys) > 1:
        raise CredentialsError("the request presents different API keys (Authorization and x-api-key, or "
                               "repeated headers, must all carry the same key)")
    return next(iter(keys), None)


def caller(headers: Iterable[tuple[bytes, bytes]], keys: ApiKeys | None) -> Caller:
    """Who the request is (raises CredentialsError for credentials that disagree). Without keys the
    daemon authenticates nobody, but the key still names the owner of what the caller stores."""
    key = presented_key(headers, strict=keys is not None)
    return Caller(key, None if keys is None or key is None else keys.tenant_of(key))


def scoped_salt(tenant: str | None, salt: str | None) -> str | None:
    """The salt the engine folds into a request's hash-chain root: the client's `cache_salt` within
    its tenant's scope (None: caches are shared, the salt alone divides). Under isolation every request
    has a tenant, so every salt the engine sees is of this form and no raw salt can name a tenant's
    scope."""
    return salt if tenant is None else json.dumps(["tenant", tenant, salt])
