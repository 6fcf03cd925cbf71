"""Request ids: what the gateway answers every scored call with, and what a click names.

``<issued ms, base 36>.<48 random bits, hex>.<examples>.<mac>``, e.g.
``m4b9x2k1.3f9a0c4e21b7.100.9c1e5a7730d2b4f1``: the MAC is HMAC-SHA256 of the rest under the
feature log's key (``feature_log.key_file``), cut to 64 bits. Any gateway holding the key checks
an id without shared state (no table of ids issued, nothing to replicate): whether this stack
issued it, when, and for how many examples, which is what ``Feedback`` must know to refuse a
click on an example that was never scored or from before it was. The random part makes ids
unique across gateways issuing in the same millisecond.

Issuing is on every scoring call: one HMAC over ~25 bytes from a precomputed key state
(``hmac.copy``), a few microseconds. Sampling (:meth:`RequestIds.sampled`) is a function of the
id (its MAC's last 32 bits), so every gateway decides alike for a request: a click can be
checked against the feature log's sample without asking anyone.

The key file is created 0600 (32 random bytes, hex) when missing, by whichever gateway comes
first (an exclusive create: two starting at once agree on one key); a key others or its group
can write is refused (serving/gateway/filemode.py). Without a key file and with the feature log
off, a process draws its own key: ids are still issued, checked by nobody.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import random
import time
from pathlib import Path
from typing import NamedTuple

from serving.gateway.filemode import check_private

logger = logging.getLogger("serving.gateway")
MAC_CHARS = 16  # hex: 64 bits of HMAC-SHA256
KEY_BYTES = 32
_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"
_SAMPLE_SPACE = float(1 << 32)


class KeyFileError(ValueError):
    """The request-id key file cannot be used (one line: what to do)."""


class Issued(NamedTuple):
    """What a valid request id says: when it was issued and for how many examples."""

    issued_ms: int
    examples: int


def base36(n: int) -> str:
    """``n`` >= 0 in base 36 (lower case): ``int(text, 36)`` reads it back."""
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = _DIGITS[r] + out
        if not n:
            return out


def load_key(path: Path) -> bytes:
    """The key in ``path`` (created 0600 with a random key when missing); KeyFileError when it
    is unreadable, empty or writable by others."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, os.urandom(KEY_BYTES).hex().encode() + b"\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        try:  # exclusive: a gateway that got there first keeps its key, and we read it
            os.link(tmp, path)
            logger.info("feature log: created the request-id key %s (mode 0600)", path)
        except FileExistsError:
            pass
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    refusal, warning = check_private(path)
    if refusal:
        raise KeyFileError(f"feature_log.key_file: {refusal}")
    if warning:
        logger.warning("feature_log.key_file: %s", warning)
    try:
        key = path.read_bytes().strip()
    except OSError as e:
        raise KeyFileError(
            f"feature_log.key_file {path}: {e.strerror or e} (every gateway of the stack needs "
            "the same key; delete the file to have a new one made)"
        ) from None
    if len(key) < 16:
        raise KeyFileError(
            f"feature_log.key_file {path}: {len(key)} bytes, a key needs 16 or more (delete it "
            "to have a new one made, then give it to every gateway of the stack)"
        )
    return key


class RequestIds:
    """Issues and checks request ids under one key."""

    def __init__(self, key: bytes) -> None:
        self._mac = hmac.new(key, digestmod=hashlib.sha256)
        self._random = random.Random(os.urandom(16))  # uniqueness, not secrecy: the MAC signs

    @classmethod
    def own(cls) -> RequestIds:
        """A key of this process only (no feature log: ids nobody checks)."""
        return cls(os.urandom(KEY_BYTES))

    def _sign(self, body: str) -> str:
        mac = self._mac.copy()
        mac.update(body.encode())
        return mac.hexdigest()[:MAC_CHARS]

    def issue(self, examples: int, now_ms: int | None = None) -> str:
        """A new id for a call of ``examples`` examples, issued now (or at ``now_ms``)."""
        ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
        body = f"{base36(ms)}.{self._random.getrandbits(48):012x}.{examples}"
        return f"{body}.{self._sign(body)}"

    def check(self, request_id: str) -> Issued:
        """What ``request_id`` says; ValueError (one line) when it is malformed or was not
        issued under this key."""
        parts = request_id.split(".")
        if len(parts) != 4 or len(request_id) > 80:
            raise ValueError(
                "is not a request id of this gateway (<ms>.<random>.<examples>.<mac>, as "
                "ScoreResponse.request_id gives it)"
            )
        ms, rand, examples, mac = parts
        try:
            issued = Issued(int(ms, 36), int(examples, 10))
            int(rand, 16)
        except ValueError:
            raise ValueError("is malformed (its fields are not numbers)") from None
        if not hmac.compare_digest(self._sign(f"{ms}.{rand}.{examples}"), mac):
            raise ValueError("was not issued by this stack (its MAC does not match our key)")
        return issued

    @staticmethod
    def sampled(request_id: str, fraction: float) -> bool:
        """Whether the feature log keeps ``request_id``'s examples (a fraction of the ids,
        the same answer on every gateway: its MAC's last 32 bits)."""
        if fraction >= 1.0:
            return True
        return int(request_id[-8:], 16) < fraction * _SAMPLE_SPACE
