"""The continuous loop's delta path (``continuous.deltas``): publish a pass as embedding deltas.

When a stack serves this model and ``RUN/export`` is the export of its default version (the
loop's last full publish), a due publish is a delta instead of an export + rollout:

1. ``training.export.delta``, in the loop's process, for the tables the workers serve
   (schema.json's CPU variant: int8, int4, or mixed, section by section): the checkpoint's
   rows whose bytes differ from what the workers serve (the default's mapped tables + its
   chain), the dense weights, into ``<store>/deltas/<model>/<default>/``; what serves now and
   the candidate scored on the arriving file's first ``rollout_eval_rows`` rows (rows the
   candidate never trained on);
   Only the rows the passes since what serves trained on are compared when the loop knows
   them (:mod:`.touched`; ``compared`` in the record: their count, or "all");
2. ``serving.tools.deltas publish``, in the loop's process (no cold start): those scores
   judged by the rollout's rules (``continuous.rollout_args``' margin, the near-chance
   refusal), every worker's format checked, the pointer moved, every worker of every replica
   acknowledging within ``continuous.delta_timeout_s``; ``continuous.delta_dwell_s`` > 0:
   the gateway's error gate, a failure rolled back.

**Falling back.** A variant with no delta path (fp16/fp32 tables, TorchScript), a delta that
cannot be made, one a worker refuses (its own error is recorded: another format, CUDA, a
checksum) or does not acknowledge in time, or one the error gate rolls back: the delta record
says why (``fallback``) and the same publish goes on as a full export + rollout. A delta the
evaluated gate refuses does not: the rollout would judge the full export by the same rule on
the same rows. A refused delta's files are removed and it is no publish (:func:`counted`): the
next file tries again.

Every ``continuous.compact_every`` deltas (the chain that long) the publish is a full export
+ rollout again (compaction): a new version, a new mapped file, an empty chain. The record in
``continuous.jsonl``: format, rows, bytes, the gate's figures, ``served_s`` (pointer -> every
worker), ``freshness_s`` (end of the pass -> the last worker's acknowledgement, by its own
clock) and ``acked_at`` (that acknowledgement, unix seconds: the online demo's click-to-served
figure ends there).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recsys_model.delta import DeltaError, read_pointer
from training.checkpoint import store as checkpoint
from training.continuous.config import ContinuousConfig, serving_stack
from training.continuous.touched import Touched, chain_end
from training.errors import RecsysError
from training.export.delta import gate, make_delta, served_format, unseen_arrays

FULL = "full export + rollout"  # what follows a delta record with ``fallback``


def delta_target(cfg: ContinuousConfig, run_dir: Path, store: Path, name: str) -> Path | None:
    """The deltas folder of the served default when a delta can be published over it (its
    export is ``RUN/export``, its chain shorter than ``compact_every``), else None."""
    c = cfg.continuous
    try:
        default = str(json.loads((c.serve_dir / "plan.json").read_text())["default"])
        schema = json.loads((run_dir / "export" / "schema.json").read_text())
    except (OSError, ValueError, KeyError):
        return None
    if str(schema["model"]["version"]) != default or schema["model"]["name"] != name:
        return None
    folder = Path(store).resolve() / "deltas" / name / default
    if len(read_pointer(folder)["chain"]) >= c.compact_every:
        return None  # compaction: a full export replaces the chain
    return folder


def counted(records: list[dict[str, Any]]) -> bool:
    """Whether records of ``continuous.jsonl`` hold a publish (the ledger's export clock
    restarts): an export (made or failed), or a delta every worker serves; a refused delta
    alone is none."""
    return any(r.get("event") == "export" or (r.get("event") == "delta" and r.get("promoted"))
               for r in records)  # fmt: skip


def try_delta(
    cfg: ContinuousConfig, run_dir: Path, store: Path, base: dict[str, Any], unseen: Path,
    pass_end: float, touched: Touched | None = None, early: Early | None = None,
) -> dict[str, Any] | None:  # fmt: skip
    """The delta record of this publish; None when none is due (not the default's export,
    compaction): a full publish. A record with ``fallback``: a full publish follows."""
    folder = delta_target(cfg, run_dir, store, base["model"])
    if folder is None:
        return None
    fmt, why = served_format(_schema(run_dir))
    if fmt is None:
        return {**base, "event": "delta", "base": folder.name, "promoted": False,
                "reason": why, "fallback": FULL}  # fmt: skip
    return publish_delta(cfg, run_dir, folder, base, unseen, pass_end, fmt, touched, early)


def served_store(c: Any, name: str) -> tuple[str | None, Path, bool]:
    """(the model the stack serves, the store a publish goes to, whether a delta may be
    tried: deltas on, this model served, a store known); the one rule for the publish and
    :class:`Early`."""
    served, store = serving_stack(c.serve_dir) if c.rollout else (None, None)
    store = Path(store or c.model_store)
    return served, store, bool(c.deltas and served == name)


def state(folder: Path, run_dir: Path) -> tuple[tuple[str, str], Path | None]:
    """(the chain end of ``folder``, ``run_dir``'s latest checkpoint): what a delta is over."""
    return chain_end(folder, read_pointer(folder)["chain"]), checkpoint.read_latest(
        run_dir / "checkpoints"
    )


@dataclass
class Made:
    """A delta made and scored, not published: its record's fields, the publisher's record,
    its files; or the error that stopped it."""

    key: tuple[str, str, str]  # (deltas folder, the chain's last file, checkpoint) it is over
    fields: dict[str, Any] = field(default_factory=dict)
    entry: dict[str, Any] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    error: str = ""


def make(
    cfg: ContinuousConfig, run_dir: Path, folder: Path, version: str, unseen: Path, fmt: str,
    touched: Touched | None,
) -> Made:  # fmt: skip
    """The delta of ``run_dir``'s latest checkpoint over ``folder``'s chain for ``fmt`` tables,
    scored with what serves on ``unseen``'s first rows (the gate's figures, judged later)."""
    t0 = time.perf_counter()
    end, ckpt = state(folder, run_dir)
    m = Made((*end, str(ckpt)))
    try:  # in this process (torch imported): the import is no part of the freshness
        if ckpt is None:
            raise DeltaError(f"{run_dir}: no checkpoint")
        since = touched.since(end) if touched else None
        m.fields["compared"] = "all" if since is None else int(sum(len(t) for t in since))
        delta, now, candidate = make_delta(ckpt, cfg.model, run_dir / "export", folder, version,
                                           fmt, since)  # fmt: skip
        m.files = [folder / delta["file"], folder / f"{Path(delta['file']).stem}.judge.npz"]
        arrays = unseen_arrays(unseen, cfg, cfg.continuous.rollout_eval_rows)
        judged = gate(now, candidate, arrays, m.files[1])
    except (DeltaError, OSError, ValueError, RecsysError) as e:
        _remove(folder, m.files)
        m.error, m.files = f"delta not made: {e}", []
        return m
    m.entry = {**delta, "gate": judged}
    m.fields.update(rows=delta["rows"], bytes=delta["bytes"], gate=judged,
                    make_s=round(time.perf_counter() - t0, 2), delta_s=delta["seconds"],
                    diff_s=delta["diff_s"])  # fmt: skip
    return m


class Early:
    """The delta the next publish will need, made in a thread (rank 0) while the loop scores
    the file it will be judged on (progressive validation, the quarantine checks), so their
    costs overlap instead of adding up. The publish takes it when it is over the same folder,
    chain end and checkpoint, else makes its own; one not taken is removed."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.thread: threading.Thread | None = None
        self.made: Made | None = None

    def start(self, unseen: Path) -> None:
        """Start making the delta the publish due at ``unseen`` will want (if any)."""
        self.discard()
        loop = self.loop
        if loop.rank != 0 or not loop.c.deltas or not loop.due():
            return
        name = f"dlrm-{loop.cfg.name}"
        _, store, ok = served_store(loop.c, name)
        folder = delta_target(loop.cfg, loop.run_dir, store, name) if ok else None
        fmt = served_format(_schema(loop.run_dir))[0]
        if folder is None or fmt is None:
            return
        args = (loop.cfg, loop.run_dir, folder, str(loop.progress.step), unseen, fmt,
                loop.touched)  # fmt: skip
        self.thread = threading.Thread(target=lambda: setattr(self, "made", make(*args)),
                                       name="early-delta", daemon=True)  # fmt: skip
        self.thread.start()

    def take(self, key: tuple[str, str, str]) -> Made | None:
        """The delta made early when it is over ``key``; None (and it removed) otherwise."""
        if self.thread is not None:
            self.thread.join()
        made, self.made, self.thread = self.made, None, None
        if made is not None and made.key != key:
            _remove(Path(made.key[0]), made.files)
            return None
        return made

    def discard(self) -> None:
        self.take(("", "", ""))


def _schema(run_dir: Path) -> dict[str, Any]:
    try:
        return dict(json.loads((run_dir / "export" / "schema.json").read_text()))
    except (OSError, ValueError) as e:
        return {"error": str(e)}


def publish_delta(
    cfg: ContinuousConfig, run_dir: Path, folder: Path, base: dict[str, Any], unseen: Path,
    pass_end: float, fmt: str = "int8", touched: Touched | None = None,
    early: Early | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Make (or take from ``early``), gate and publish the delta of ``run_dir``'s latest
    checkpoint over ``folder`` for ``fmt`` tables; the record (module doc)."""
    c = cfg.continuous
    record: dict[str, Any] = {**base, "event": "delta", "base": folder.name, "format": fmt,
                              "promoted": False,  # since_pass_s: the next file's load + scoring
                              "since_pass_s": round(time.time() - pass_end, 2)}  # fmt: skip
    end, ckpt = state(folder, run_dir)
    m = early.take((*end, str(ckpt))) if early is not None else None
    record["early"] = m is not None  # made while the loop scored the file
    if m is None:
        m = make(cfg, run_dir, folder, str(base["version"]), unseen, fmt, touched)
    record.update(m.fields)
    if m.error:
        return {**record, "reason": m.error, "fallback": FULL}
    t1 = time.perf_counter()
    out = PUBLISHER.call(["publish", "--workdir", str(c.serve_dir), "--record",
                          json.dumps(m.entry), "--dwell-s",
                          str(c.delta_dwell_s), "--timeout-s", str(c.delta_timeout_s),
                          "--rollout-args", json.dumps(list(c.rollout_args))])  # fmt: skip
    acked = float(out.get("acked_at") or time.time())  # the last worker's ack: it serves now
    record.update(publish_s=round(time.perf_counter() - t1, 2),
                  **{k: out[k] for k in ("found_s", "judged_s") if k in out})  # fmt: skip
    record.update(promoted=bool(out.get("promoted")), served_s=out.get("served_s"),
                  workers=out.get("workers"), reason=out.get("reason"),
                  freshness_s=round(acked - pass_end, 2), acked_at=round(acked, 3))  # fmt: skip
    if record["promoted"] and touched is not None:  # what serves now: this delta
        touched.restart(chain_end(folder, read_pointer(folder)["chain"]), int(base["step"]))
    if isinstance(out.get("gate"), dict):
        record["gate"] = {**m.entry["gate"], **out["gate"]}
    record["gate"].pop("judge", None)  # its file is removed below
    _remove(folder, m.files[1:] if record["promoted"] else m.files)
    if not record["promoted"] and out.get("refused") != "gate":
        record["fallback"] = FULL
    return record


class Publisher:
    """``python -m serving.tools.deltas lines``, started once and kept warm (serving's
    imports done: the ~6 s a cold ``publish`` process cost at each delta); a command per
    call. Its own process: training never imports serving (tests/test_structure.py). It ends
    when the loop does (its stdin closes); one that died is started again at the next call."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-m", "serving.tools.deltas", "lines"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip

    def call(self, argv: list[str]) -> dict[str, Any]:
        """The record of ``serving.tools.deltas`` for ``argv`` (``reason`` on any failure)."""
        for _ in range(2):  # a publisher that died meanwhile: once more, started afresh
            self.start()
            assert self.proc is not None and self.proc.stdin and self.proc.stdout
            try:
                self.proc.stdin.write(json.dumps(argv) + "\n")
                self.proc.stdin.flush()
                line = self.proc.stdout.readline()
            except (OSError, ValueError):
                line = ""
            if line:
                try:
                    out: dict[str, Any] = json.loads(line)
                    return out
                except ValueError:
                    return {"promoted": False, "reason": f"the publisher said {line[:300]!r}"}
        code = self.proc.poll() if self.proc else None
        return {"promoted": False, "reason": f"the publisher (serving.tools.deltas) exited {code}"}


PUBLISHER = Publisher()


def prepare(run_dir: Path, cfg: ContinuousConfig, step: int, rank: int) -> Touched:
    """The loop's delta state on ``rank``: its :class:`Touched` rows, and (rank 0, deltas on)
    the publisher started now, warm by the first publish."""
    on = rank == 0 and cfg.continuous.deltas
    if on:
        PUBLISHER.start()
    return Touched(run_dir / "touched.npz", cfg.model.rows(), step, on)


def _remove(folder: Path, files: list[Path]) -> None:
    """Delete ``files`` of ``folder`` the pointer does not name (a refused delta's)."""
    named = {e["file"] for e in read_pointer(folder)["chain"]} if folder.is_dir() else set()
    for path in files:
        if path.name not in named:
            path.unlink(missing_ok=True)
