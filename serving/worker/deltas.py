"""A worker's chain of embedding deltas: which version it serves, moved whole (docs/serving.md).

The folder of a served version is ``$RECSYS_DELTA_DIR/<model>/<base version>/``: the delta files
(recsys_model/delta.py), ``current.json`` (the chain to serve, replaced by rename by
``serving.tools.deltas``) and ``acks/<pid>.json``, where each worker says what it serves. A
thread polls the pointer (one ``stat`` every :data:`POLL_S`), reads and checks the new deltas
and builds the next :class:`~recsys_model.delta.OverlayScorer` off the request path, then
swaps it in by one assignment; a batch scores with the scorer it took when it started. A
delta that fails (checksum, base, order, shapes) leaves the version serving and is reported
in the worker's describe answer; a worker killed while applying served the old version until
then, and its restart applies the pointer before it reports READY. The last :data:`KEEP`
chains stay built, so a rollback (the pointer back to a shorter chain) is a swap, no I/O.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

try:  # inside a TorchServe worker the archive's files sit side by side
    from atomic import write_atomic  # type: ignore[import-not-found]
    from delta import POINTER, DeltaError, merge, overlay, read_delta  # type: ignore[import-not-found]
except ImportError:
    from recsys_model.atomic import write_atomic
    from recsys_model.delta import POINTER, DeltaError, merge, overlay, read_delta

logger = logging.getLogger(__name__)
DELTA_DIR_ENV = "RECSYS_DELTA_DIR"
POLL_S = 0.2
KEEP = 3  # chains kept built: the serving one and the ones a rollback returns to
# Fault injection for the kill-mid-apply test: seconds to wait after reading, before the swap.
APPLY_DELAY_ENV = "RECSYS_TEST_DELTA_APPLY_S"
Chain = tuple[tuple[str, str], ...]  # (file, sha256) of each delta, in order


def folder_for(root: str, model: str, version: str) -> Path:
    """Where the deltas of ``model`` ``version`` (a ``.mar``) live under ``root``."""
    return Path(root) / model / version


class Deltas:
    """The versions one worker serves from ``folder`` over the ``base`` scorer (module doc)."""

    def __init__(self, folder: Path, base: Any, base_version: str, base_sha256: str) -> None:
        self.folder, self.base_version, self.base_sha256 = folder, base_version, base_sha256
        self.current: Any = base  # what a batch scores with: swapped whole
        self.label, self.error = "", ""
        self.chain: Chain = ()
        empty = torch.empty(0, dtype=torch.int64)
        self.kept: dict[Chain, tuple[Any, torch.Tensor, torch.Tensor, str]] = {
            (): (base, empty, torch.empty(0, 0, dtype=torch.uint8), "")
        }
        self.base = base
        self.seen: tuple[int, int, int] | None = None
        self._stop = threading.Event()

    def poll(self) -> bool:
        """Apply the pointer when it changed since the last look; True when the version moved."""
        path = self.folder / POINTER
        try:
            st = path.stat()
        except FileNotFoundError:
            return False
        ident = (st.st_ino, st.st_mtime_ns, st.st_size)
        if ident == self.seen:
            return False
        self.seen = ident
        before = self.label, self.chain
        try:
            self.apply(json.loads(path.read_text()))
            self.error = ""
        except (DeltaError, OSError, ValueError, KeyError, RuntimeError) as e:
            self.error = f"{path}: {e}"
            logger.error("delta not applied, still serving %s: %s", self.label or "base", e)
        self.ack()
        return (self.label, self.chain) != before

    def apply(self, pointer: dict[str, Any]) -> None:
        """Serve ``pointer``'s chain (built from the longest chain kept that starts it)."""
        if str(pointer.get("base")) != self.base_version:
            raise DeltaError(f"the pointer is for base {pointer.get('base')}, this worker "
                             f"serves {self.base_version}")  # fmt: skip
        entries = list(pointer["chain"])
        key: Chain = tuple((e["file"], e["sha256"]) for e in entries)
        if key == self.chain:
            return
        start = max((n for n in range(len(key) + 1) if key[:n] in self.kept), default=0)
        model, ids, rows, label = self.kept[key[:start]]
        weights = None
        for entry in entries[start:]:
            delta = read_delta(self.folder / entry["file"], entry)
            if (str(delta["base"]), delta["base_sha256"]) != (self.base_version, self.base_sha256):
                raise DeltaError(f"{entry['file']}: made for base {delta['base']}, not this one")
            if delta["parent"] != label:
                raise DeltaError(f"{entry['file']}: follows {delta['parent']!r}, not {label!r}")
            ids, rows = merge(ids, rows, delta["ids"], delta["rows"])
            weights, label = delta["weights"], delta["version"]
        if weights is not None:
            model = overlay(self.base, ids, rows, weights, label)
        delay = float(os.environ.get(APPLY_DELAY_ENV, "0") or 0)
        if delay:
            time.sleep(delay)
        self.current, self.chain, self.label = model, key, label  # the swap: one assignment
        self.kept[key] = (model, ids, rows, label)
        while len(self.kept) > KEEP + 1:  # the base and the last KEEP chains
            del self.kept[next(k for k in self.kept if k and k != key)]

    def ack(self) -> None:
        """``acks/<pid>.json``: what this worker serves now (written aside, renamed in)."""
        acks = self.folder / "acks"
        try:
            acks.mkdir(exist_ok=True)
            write_atomic(acks / f"{os.getpid()}.json", json.dumps(
                {"pid": os.getpid(), "version": self.label, "error": self.error,
                 "time": time.time()}))  # fmt: skip
        except OSError as e:  # a read-only folder: the describe answer still says it
            logger.warning("cannot write %s: %s", acks, e)

    def watch(self) -> threading.Thread:
        """Poll in a daemon thread until :meth:`stop`."""

        def loop() -> None:
            while not self._stop.wait(POLL_S):
                try:
                    self.poll()
                except Exception:  # the thread must outlive any surprise; serving goes on
                    logger.exception("delta watcher")

        thread = threading.Thread(target=loop, name="delta-watcher", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stop.set()
