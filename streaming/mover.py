"""Committed parts of Flink's file sink -> the continuous loop's input folder, exactly once.

Flink's file sink writes exactly once, but in its own shape: a part file per checkpoint (named
``part-<uuid>-<subtask>-<n>``, not in the order of creation across restarts, as small as one
checkpoint's rows). The continuous loop wants complete files in natural name order, each at least
one training batch (it rejects smaller ones). So the sink commits into a staging folder, and this
mover turns committed parts into ``joined-<ms>-<n>.tsv`` files of at least ``min_rows`` rows
and both labels (rows wait in staging for the next file otherwise).

**Crash safety** (a ``kill -9`` anywhere, of everything). One batch at a time:

1. the rows of the chosen parts go to a hidden ``out/.joined-<ms>-<n>.tsv.tmp`` (the loop never
   reads hidden files), flushed and synced;
2. the mover's state (:func:`recsys_model.atomic.write_atomic`) records the batch: its name, its
   parts, its manifest entry. This write is the commit point;
3. the temporary file is renamed in, the manifest line appended, the parts deleted, and the
   state's batch cleared.

At start (:meth:`Mover.recover`) a recorded batch is finished (each of the steps of 3 is
idempotent: rename if the temporary file is there, append the line if the manifest lacks it,
delete the parts still there) and any other ``.joined-*.tmp`` is a batch never committed: its
parts are still in staging, so it is deleted and redone. No row is lost or written twice.

Each staged line is ``<click event ms>\\t<label>\\t<row>`` (:mod:`streaming.join`): the first field
goes to the manifest (the online demo's click-to-served freshness), the rest to the file.
Standard library only.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from recsys_model.atomic import fsync_dir, write_atomic

logger = logging.getLogger("streaming.mover")
PREFIX, SUFFIX = "joined-", ".tsv"
PART_PREFIX = "part"


def committed_parts(staging: Path) -> list[Path]:
    """The parts Flink committed (its in-progress and pending files are hidden: ``.part-*``),
    oldest first."""
    if not staging.is_dir():
        return []
    parts = [p for p in staging.iterdir() if p.name.startswith(PART_PREFIX) and p.is_file()]
    return sorted(parts, key=lambda p: (p.stat().st_mtime_ns, p.name))


class Mover:
    """Moves committed parts from ``staging`` into ``out`` (module doc); ``manifest``: one
    JSON line per file; ``state_file``: the mover's own progress."""

    def __init__(
        self, staging: Path, out: Path, manifest: Path, state_file: Path, min_rows: int
    ) -> None:
        self.staging, self.out, self.manifest = Path(staging), Path(out), Path(manifest)
        self.state_file, self.min_rows = Path(state_file), min_rows
        self._rows: dict[str, tuple[int, int]] = {}  # part -> rows, positives (never change)
        self.state: dict[str, Any] = {"next": 0, "last_ms": 0, "batch": None}

    def recover(self) -> None:
        """Finish the batch a crash interrupted, drop uncommitted temporary files."""
        for d in (self.staging, self.out, self.manifest.parent):
            d.mkdir(parents=True, exist_ok=True)
        if self.state_file.exists():
            self.state = json.loads(self.state_file.read_text())
        self._trim_manifest()
        batch = self.state.get("batch")
        if batch:
            logger.info("finishing %s (interrupted after its commit)", batch["entry"]["name"])
            self._finish(batch)
        for tmp in self.out.glob(f".{PREFIX}*{SUFFIX}.tmp"):
            logger.info("dropping %s: never committed, its parts are still staged", tmp.name)
            tmp.unlink()

    def step(self) -> int:
        """Write one file if the committed parts hold ``min_rows`` rows; its rows (0: none)."""
        parts = committed_parts(self.staging)
        counts = [self._count(p) for p in parts]
        total, positives = sum(c[0] for c in counts), sum(c[1] for c in counts)
        # both labels too: the loop rejects a file of one label (the first W of a run is
        # clicks only: they wait for the first closed windows' zeros)
        if not parts or total < self.min_rows or not 0 < positives < total:
            return 0
        n = int(self.state["next"])
        ms = max(int(time.time() * 1000), int(self.state["last_ms"]) + 1)
        name = f"{PREFIX}{ms}-{n:06d}{SUFFIX}"
        tmp = self.out / f".{name}.tmp"
        rows = positives = 0
        clicks: list[int] = []
        with open(tmp, "w") as f:
            for part in parts:
                for line in part.read_text().splitlines():
                    click, _, labelled = line.partition("\t")
                    if not labelled:
                        continue
                    f.write(labelled + "\n")
                    rows += 1
                    if click:
                        positives += 1
                        clicks.append(int(click))
            f.flush()
            os.fsync(f.fileno())
        entry = {"name": name, "rows": rows, "positives": positives,
                 "click_event_ms": sorted(clicks), "parts": len(parts)}  # fmt: skip
        batch = {"entry": entry, "parts": [p.name for p in parts]}
        self.state = {"next": n + 1, "last_ms": ms, "batch": batch}
        write_atomic(self.state_file, json.dumps(self.state))  # the commit point
        self._finish(batch)
        return rows

    def _count(self, part: Path) -> tuple[int, int]:
        """A part's rows and positives (a staged line with a click time: label 1)."""
        if part.name not in self._rows:
            rows = positives = 0
            with open(part, "rb") as f:
                for line in f:
                    rows += 1
                    positives += not line.startswith(b"\t")
            self._rows[part.name] = (rows, positives)
        return self._rows[part.name]

    def _finish(self, batch: dict[str, Any]) -> None:
        entry = dict(batch["entry"])
        final = self.out / entry["name"]
        tmp = self.out / f".{entry['name']}.tmp"
        if tmp.exists():
            os.replace(tmp, final)
            fsync_dir(self.out)
            entry["renamed_ms"] = int(time.time() * 1000)
        else:  # renamed before the crash: its change time is when
            entry["renamed_ms"] = int(final.stat().st_ctime * 1000)
        if not self._in_manifest(entry["name"]):
            with open(self.manifest, "a") as f:
                f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
        for name in batch["parts"]:
            (self.staging / name).unlink(missing_ok=True)
            self._rows.pop(name, None)
        fsync_dir(self.staging)
        self.state = {**self.state, "batch": None}
        write_atomic(self.state_file, json.dumps(self.state))
        logger.info("%s: %d rows (%d positive)", entry["name"], entry["rows"], entry["positives"])

    def _in_manifest(self, name: str) -> bool:
        """Whether ``name``'s line was appended (only the last batch can be: read the tail)."""
        if not self.manifest.exists():
            return False
        with open(self.manifest, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - (1 << 20)))
            tail = f.read().decode(errors="replace")
        return f'"name": "{name}"' in tail

    def _trim_manifest(self) -> None:
        """Cut a line half-appended by a crash (the batch is then finished again)."""
        if not self.manifest.exists():
            return
        raw = self.manifest.read_bytes()
        if raw and not raw.endswith(b"\n"):
            write_atomic(self.manifest, raw[: raw.rfind(b"\n") + 1])
