"""HTTP basic auth against the web config's bcrypt users, without becoming a DoS lever.

bcrypt at cost 10 takes tens of milliseconds of CPU by design. So, as the exporter-toolkit
does: a credential verified once is cached, and bcrypt runs for at most one request at a
time. Here it also runs off the event loop, in one dedicated thread (the ``bcrypt`` package
releases the GIL while it hashes), so a flood of wrong passwords queues behind that one
thread while cached scrapes, token ingest and ``/healthz`` are answered on the loop.

The cache is keyed by SHA-256 of (user, stored hash, password): it never holds a password,
and a user whose hash changes in the file (rotation) is verified afresh.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import bcrypt

CACHE_SIZE = 256
"""Verified credentials remembered (least recently used go first)."""
_ABSENT_USER_HASH = b"$2y$10$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi"
"""bcrypt of "fakepassword" (the toolkit's): an unknown user costs what a known one costs,
so timing does not tell which users exist."""


def parse_basic(header: str | None) -> tuple[str, str] | None:
    """``(user, password)`` from an ``Authorization: Basic ...`` value, else ``None``."""
    if header is None:
        return None
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, colon, password = decoded.partition(":")
    return (user, password) if colon else None


def _check(password: bytes, hashed: bytes) -> bool:
    try:
        return bcrypt.checkpw(password, hashed)
    except ValueError:  # over 72 bytes (bcrypt 5 refuses to truncate), or a bad hash
        return False


class BasicAuthVerifier:
    """Verifies basic-auth credentials against bcrypt hashes; one per app.

    ``verify`` is a coroutine: a cached credential costs a SHA-256 on the loop; an uncached
    one waits for the single bcrypt thread.
    """

    def __init__(self) -> None:
        self._cache: OrderedDict[bytes, None] = OrderedDict()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ampscope-bcrypt")
        self.bcrypt_calls = 0
        """bcrypt comparisons run so far (tests read it to see the cache work)."""

    async def verify(self, users: Mapping[str, str], user: str, password: str) -> bool:
        """True when ``user`` exists in ``users`` and ``password`` matches its hash."""
        stored = users.get(user)
        hashed = _ABSENT_USER_HASH if stored is None else stored.encode()
        key = hashlib.sha256(b"\0".join((user.encode(), hashed, password.encode()))).digest()
        if key in self._cache:
            self._cache.move_to_end(key)
            return stored is not None
        self.bcrypt_calls += 1
        loop = asyncio.get_running_loop()
        ok = await loop.run_in_executor(self._executor, _check, password.encode(), hashed)
        if ok and stored is not None:
            self._cache[key] = None
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return ok and stored is not None

    def close(self) -> None:
        """Stop the bcrypt thread (after the queue drains)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
