"""TorchServe's ``key_file.json``: the one reader of it.

TorchServe 0.12 (token authorization on) writes, at every start, into its working directory::

    {"management": {"key": "...", "expiration time": "..."},
     "inference": {"key": "...", ...}, "API": {"key": "...", ...}}

Inference calls (REST and gRPC) carry ``authorization: Bearer <inference key>``. Standard
library only: the gateway and the container healthcheck use it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

KINDS = ("inference", "management", "API")
INFERENCE = ("inference",)  # all the gateway reads


class KeyFileError(RuntimeError):
    """``key_file.json`` is missing, unreadable or not shaped as TorchServe writes it."""


def read_keys(path: Path, kinds: Sequence[str] | None = None) -> dict[str, str]:
    """``{kind: key}`` from TorchServe's key file: those of ``kinds`` (None: every entry, as
    the management tools read it). An ``inference`` key must be there, and every kind asked
    for; entries not asked for are neither checked nor returned, so the gateway, which asks
    for the inference key alone (:func:`inference_key`), never holds the management key and
    works with a copy holding only its own (compose's ``/keys``)."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise KeyFileError(f"{path} not found: is TorchServe running there?") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise KeyFileError(f"cannot read TorchServe's key file {path}: {e}") from None
    shape = '{"inference": {"key": "..."}, "management": {"key": "..."}, ...}'
    if not isinstance(data, dict):
        raise KeyFileError(f"{path}: expected {shape}, got {type(data).__name__}")
    if "inference" not in data:  # the gateway's copy in compose holds the inference key only
        raise KeyFileError(f"{path}: no 'inference' key (expected {shape})")
    keys = {}
    for kind in data if kinds is None else kinds:
        entry = data.get(kind)
        if entry is None:
            raise KeyFileError(f"{path}: no '{kind}' key (expected {shape})")
        if not isinstance(entry, dict) or not isinstance(entry.get("key"), str):
            raise KeyFileError(f"{path}: entry '{kind}' has no string 'key' (expected {shape})")
        keys[kind] = entry["key"]
    return keys


def inference_key(path: Path) -> str:
    """The key for ``authorization: Bearer <key>`` on inference calls (REST and gRPC); the
    file's other keys are not read (:func:`read_keys`)."""
    return read_keys(path, INFERENCE)["inference"]


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    """gRPC call metadata carrying ``key``."""
    return (("authorization", f"Bearer {key}"),)


class KeySource:
    """The inference key of one TorchServe, re-read when the file changes (new keys each start)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._mtime = -1
        self._metadata: tuple[tuple[str, str], ...] = ()

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Call metadata with the current key; raises :class:`KeyFileError` if unreadable."""
        try:
            mtime = self.path.stat().st_mtime_ns
        except OSError:
            return self._metadata  # TorchServe restarting: keep the last key, calls will say why
        if mtime != self._mtime:
            self._metadata = bearer(inference_key(self.path))
            self._mtime = mtime
        return self._metadata


def write_inference_copy(keys: Path, out: Path) -> None:
    """``out``: ``{"inference": {"key": ...}}`` from TorchServe's ``keys`` (mode 0600, by
    atomic rename): what a gateway reads, so that it never opens the file holding the
    management key (compose's ``/keys``, ``make serve``'s ``inference_key.json``). Raises
    :class:`KeyFileError` while ``keys`` is not written, OSError when ``out`` cannot be."""
    key = inference_key(keys)
    tmp = out.with_name(f".{out.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"inference": {"key": key}}, f)
    tmp.replace(out)
