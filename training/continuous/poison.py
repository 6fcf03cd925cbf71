"""Poisoned files stopped before any model trains on them: the quarantine.

After its progressive validation and before anything is published or trained on it, an
arriving file is compared with the recent files (the last ``continuous.quarantine_window``
trained, quarantined ones apart, from ``RUN/progressive.jsonl``):

- **label rate**: its label odds (rate / (1 - rate)) against the recent files' median, either
  way, by more than ``continuous.quarantine_label_odds`` (3: a CTR of 0.25 against 0.10);
- **progressive AUC**: the model's AUC on it against the model's median on the recent files
  (those scored by a trained model), lower by more than ``continuous.quarantine_auc_drop``
  (0.15); an AUC below 0.5 is named: the labels look inverted (the model ranks the file's
  clicks below its non-clicks), never "near chance".

The AUC is the current model's, which trains only on files that passed. When only the AUC
flags the file and the current weights are not the served version's (a stack serves this
model, or a version was pinned: :mod:`.served`), the file is scored by the served version's
weights too (loaded, then the current ones again, from the latest checkpoint), and it is
quarantined only when they flag it as well: a model broken by its own training (learning rates
100x) makes a clean file look bad; the gate then refuses that model, not the file.

A flagged file is **quarantined**: moved to ``DATA_DIR/quarantine/`` (its ``.prob.npy`` too)
with ``<name>.reason.txt``, one ``"quarantined"`` record in ``RUN/continuous.jsonl`` (the
checks and their figures), a WARNING line naming the check and the numbers, counted in the
run's final JSON (``"quarantined"``). It is not published on, not trained, and it carries no
rows: those carried out of the file before it go to the next file that passes. The loop goes on
with the next file. Score-only runs (``continuous.learn = false``) quarantine nothing. To train
a quarantined file anyway, move it back with a bound that lets it pass (or 0: off).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from training.checkpoint import store as checkpoint
from training.continuous import inbox
from training.continuous.inbox import FileRecord
from training.continuous.publish import from_rank0
from training.continuous.served import load_weights, served_checkpoint
from training.data.loader import Arrays
from training.metrics.evaluator import evaluate

Continuous = Any  # training.continuous.file_loop.Continuous (not imported: it imports this)

logger = logging.getLogger("training.continuous")
QUARANTINE = "quarantine"


def odds(rate: float) -> float:
    r = min(max(rate, 1e-6), 1 - 1e-6)
    return r / (1 - r)


def _last(n: int) -> str:
    return "the last file" if n == 1 else f"the last {n} files"


def auc_words(auc: float) -> str:
    """What an AUC says about the labels of the rows it was measured on."""
    if auc < 0.5:
        return "below chance (0.5): labels look inverted"
    return "near chance" if auc < 0.55 else "worse than usual"


def move(path: Path, reason: str) -> Path:
    """Move ``path`` (and its ``.prob.npy``) to ``quarantine/`` beside it, with the reason."""
    folder = path.parent / QUARANTINE
    folder.mkdir(exist_ok=True)
    (folder / (path.name + inbox.REASON_SUFFIX)).write_text(
        f"{time.strftime('%Y-%m-%d %H:%M:%S')} {path.name}: {reason}\n"
    )
    os.replace(path, folder / path.name)
    sidecar = path.with_suffix(".prob.npy")
    if sidecar.is_file():
        os.replace(sidecar, folder / sidecar.name)
    return folder / path.name


def suspect(
    mine: dict[str, Any], recent: list[dict[str, Any]], label_odds: float, auc_drop: float
) -> list[dict[str, Any]]:
    """The checks ``mine`` (the file's progressive record) fails against ``recent`` (the
    earlier files' records): ``[{"check", "reason", figures}]``, empty when it passes."""
    out: list[dict[str, Any]] = []
    rates = [float(r["label_rate"]) for r in recent if "label_rate" in r]
    if label_odds and rates and "label_rate" in mine:
        rate, median = float(mine["label_rate"]), statistics.median(rates)
        factor = math.exp(abs(math.log(odds(rate) / odds(median))))
        if factor > label_odds:
            out.append({"check": "label_rate", "label_rate": rate, "median": round(median, 6),
                        "files": len(rates), "odds_factor": round(factor, 2),
                        "reason": f"label rate {rate:.4f} against a median {median:.4f} over "
                        f"{_last(len(rates))} (odds x{factor:.1f}; bound x{label_odds:g}"
                        ": continuous.quarantine_label_odds)"})  # fmt: skip
    aucs = [float(r["auc"]) for r in recent if r.get("step", 0) > 0 and r.get("auc") is not None]
    if auc_drop and aucs and mine.get("step", 0) > 0 and mine.get("auc") is not None:
        auc, median = float(mine["auc"]), statistics.median(aucs)
        if auc < median - auc_drop:
            out.append({"check": "auc", "auc": auc, "median": round(median, 6),
                        "files": len(aucs),
                        "reason": f"progressive AUC {auc:.4f} against a median {median:.4f} over "
                        f"{_last(len(aucs))} (down {median - auc:.4f}; bound {auc_drop:g}"
                        f": continuous.quarantine_auc_drop), {auc_words(auc)}"})  # fmt: skip
    return out


class Guard:
    """The loop's quarantine (module doc)."""

    def __init__(self, loop: Continuous) -> None:
        self.loop = loop
        self.count = 0  # files quarantined by this invocation

    def _checks(self, record: FileRecord) -> list[dict[str, Any]]:
        """(rank 0) The checks the file's progressive record fails."""
        loop, c = self.loop, self.loop.c
        prog = loop._records(loop.run_dir / "progressive.jsonl")
        events = loop._records(loop.run_dir / "continuous.jsonl")
        out = {(e.get("file"), e.get("file_index")) for e in events if e["event"] == "quarantined"}
        at = [i for i, r in enumerate(prog)
              if r.get("file") == record.file and r.get("file_index") == record.index]  # fmt: skip
        if not at:
            return []
        earlier = [r for r in prog[: at[-1]] if (r.get("file"), r.get("file_index")) not in out
                   and r.get("learn", True)]  # fmt: skip
        return suspect(prog[at[-1]], earlier[-c.quarantine_window :], c.quarantine_label_odds,
                       c.quarantine_auc_drop)  # fmt: skip

    def _served_auc(self, arrays: Arrays) -> float | None:
        """The served version's AUC on the file's scored rows, when its weights are not the
        current ones (loaded for it, the current ones again after); None otherwise."""
        loop = self.loop
        paths = None
        if loop.rank == 0:
            served = served_checkpoint(loop)
            latest = checkpoint.read_latest(loop.run_dir / "checkpoints")
            step = loop.progress.step
            if served is not None and latest is not None and served.name != latest.name:
                meta = checkpoint.read_meta(latest)
                if int(meta.get("progress", {}).get("step", -1)) == step:
                    paths = (str(served), str(latest))
        paths = from_rank0(paths)
        if paths is None:
            return None
        n = loop.c.progressive_rows
        rows = arrays.rows(0, min(n, len(arrays))) if n else arrays
        load_weights(loop, Path(paths[0]))
        try:
            return float(evaluate(loop.model(), rows, loop.cfg, loop.rank, loop.world)["auc"])
        finally:
            load_weights(loop, Path(paths[1]))

    def check(self, record: FileRecord, arrays: Arrays, info: dict[str, Any]) -> bool:
        """Whether the file was quarantined (then: moved, recorded, out of the ledger, its
        cache dropped); collective."""
        loop, c = self.loop, self.loop.c
        if not c.learn or not c.quarantine_window or record.steps:  # resumed: checked before
            return False
        failed = from_rank0(self._checks(record) if loop.rank == 0 else None)
        if not failed:
            return False
        served = None
        if all(f["check"] == "auc" for f in failed):
            served = self._served_auc(arrays)
            if served is not None and served >= failed[0]["median"] - c.quarantine_auc_drop:
                if loop.rank == 0:
                    logger.warning("%s: the current model scores it AUC %.4f, the served "
                                   "version %.4f: the model is off, not the file (trained; the "
                                   "gate judges the model)", record.file, failed[0]["auc"],
                                   served)  # fmt: skip
                return False
        reason = "; ".join(f["reason"] for f in failed)
        if served is not None:
            reason += f"; the served version scores it AUC {served:.4f}, {auc_words(served)}"
        self.quarantine(record, info, failed, reason, served)
        return True

    def quarantine(
        self, record: FileRecord, info: dict[str, Any], failed: list[dict[str, Any]],
        reason: str, served: float | None,
    ) -> None:  # fmt: skip
        loop = self.loop
        if loop.rank == 0:
            path = loop.data_dir / record.file
            where = move(path, reason).parent if path.exists() else None
            logger.warning("%s QUARANTINED (-> %s), not trained, no rows carried (%s): %s",
                           record.file, where, ", ".join(f["check"] for f in failed),
                           reason)  # fmt: skip
            loop.events.write({"event": "quarantined", "file": record.file,
                               "file_index": record.index, "rows": record.rows,
                               "checks": failed, "served_auc": served, "reason": reason,
                               "step": loop.progress.step, "time": time.time()})  # fmt: skip
            if not loop.c.keep_cache and info.get("binary"):
                inbox.drop_cache(Path(info["binary"]))
        if record in loop.ledger.files:
            loop.ledger.files.remove(record)
        self.count += 1

    def summary(self) -> dict[str, Any]:
        return {"quarantined": self.count}
