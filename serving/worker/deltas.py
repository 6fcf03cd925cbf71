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

**Acknowledgements** (``acks/<pid>.json``): the label served, the chain's last file and its
sha256, the write ``time`` of the pointer answered (``pointer_time``), the tables' format and
the error of the last pointer, if any. One is written at the start too, so the publisher
knows every worker's format before it moves the pointer; a worker that serves no mapped
int8/int4/mixed tables (fp16 or fp32 tables, TorchScript, CUDA) writes one with ``deltas``
false and why (:func:`no_deltas`): a delta is refused at once, the publisher exports in full.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

try:  # inside a TorchServe worker the archive's files sit side by side
    from atomic import write_atomic  # type: ignore[import-not-found]
    from delta import (  # type: ignore[import-not-found]
        POINTER,
        DeltaError,
        Parts,
        merge_parts,
        overlay,
        read_delta,
    )
except ImportError:
    from recsys_model.atomic import write_atomic
    from recsys_model.delta import POINTER, DeltaError, Parts, merge_parts, overlay, read_delta

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

    def __init__(
        self, folder: Path, base: Any, base_version: str, base_sha256: str, fmt: str = "int8"
    ) -> None:
        self.folder, self.base_version, self.base_sha256 = folder, base_version, base_sha256
        self.fmt = fmt  # the mapped tables' format: the deltas this worker can apply
        self.current: Any = base  # what a batch scores with: swapped whole
        self.label, self.error = "", ""
        self.chain: Chain = ()
        self.pointer_time = 0.0  # the write time of the last pointer this worker looked at
        self.kept: dict[Chain, tuple[Any, Parts, str]] = {(): (base, {}, "")}
        self.base = base
        self.seen: tuple[int, int, int] | None = None
        self.acked = False
        self._stop = threading.Event()

    def poll(self) -> bool:
        """Apply the pointer when it changed since the last look; True when the version moved.
        Acknowledges every pointer it looked at, and once at the start without one."""
        path = self.folder / POINTER
        try:
            st = path.stat()
        except FileNotFoundError:
            if not self.acked:
                self.ack()  # what it serves, its format: the publisher checks them first
            return False
        ident = (st.st_ino, st.st_mtime_ns, st.st_size)
        if ident == self.seen:
            return False
        self.seen = ident
        before = self.label, self.chain
        try:
            pointer = json.loads(path.read_text())
            self.pointer_time = float(pointer.get("time", 0.0))
            self.apply(pointer)
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
        model, parts, label = self.kept[key[:start]]
        weights = None
        for entry in entries[start:]:
            delta = read_delta(self.folder / entry["file"], entry)
            self.check(entry["file"], delta, label)
            parts = merge_parts(parts, delta["parts"])
            weights, label = delta["weights"], delta["version"]
        if weights is not None:
            model = overlay(self.base, parts, weights, label)
        delay = float(os.environ.get(APPLY_DELAY_ENV, "0") or 0)
        if delay:
            time.sleep(delay)
        self.current, self.chain, self.label = model, key, label  # the swap: one assignment
        self.kept[key] = (model, parts, label)
        while len(self.kept) > KEEP + 1:  # the base and the last KEEP chains
            del self.kept[next(k for k in self.kept if k and k != key)]

    def check(self, file: str, delta: dict[str, Any], parent: str) -> None:
        """Raise :class:`DeltaError` saying why ``delta`` cannot follow ``parent`` here: its
        tables' format, then their checksum, then its place in the chain."""
        if delta.get("format") != self.fmt:
            raise DeltaError(f"{file}: a delta of {delta.get('format')} rows; this worker serves "
                             f"{self.fmt} tables: make the delta for {self.fmt}")  # fmt: skip
        if (str(delta["base"]), delta["base_sha256"]) != (self.base_version, self.base_sha256):
            raise DeltaError(f"{file}: made for version {delta['base']}'s tables (sha256 "
                             f"{str(delta['base_sha256'])[:12]}), this worker serves version "
                             f"{self.base_version}'s (sha256 {self.base_sha256[:12]})")  # fmt: skip
        if delta["parent"] != parent:
            raise DeltaError(f"{file}: follows {delta['parent']!r}, not {parent!r}")

    def ack(self) -> None:
        """``acks/<pid>.json``: what this worker serves now (its label, the chain's last file
        and checksum), the write time of the pointer it answers, its error (module doc)."""
        file, sha = self.chain[-1] if self.chain else ("", "")
        write_ack(self.folder, {"version": self.label, "error": self.error, "file": file,
                                "sha256": sha, "pointer_time": self.pointer_time,
                                "format": self.fmt, "deltas": True},
                  start=self.seen is None)  # fmt: skip
        self.acked = True

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


def write_ack(folder: Path, ack: dict[str, Any], start: bool = False) -> None:
    """``folder/acks/<pid>.json`` = ``ack`` with this process's pid and the time (written
    aside, renamed in); a folder that cannot be written is logged (the describe answer still
    says what serves): at the ``start``, before any pointer, only at debug level (a read-only
    model store that never takes a delta is no fault)."""
    acks = folder / "acks"
    try:
        acks.mkdir(parents=True, exist_ok=True)
        write_atomic(acks / f"{os.getpid()}.json",
                     json.dumps({"pid": os.getpid(), **ack, "time": time.time()}))  # fmt: skip
    except OSError as e:
        logger.log(logging.DEBUG if start else logging.WARNING, "cannot write %s: %s", acks, e)


def no_deltas(folder: Path, why: str) -> None:
    """Say in ``folder``'s acks that this worker cannot apply deltas (``why``: what it serves),
    so a publish is refused at once and the publisher exports in full instead."""
    write_ack(folder, {"version": "", "error": why, "file": "", "sha256": "",
                       "pointer_time": None, "format": None, "deltas": False}, start=True)  # fmt: skip
