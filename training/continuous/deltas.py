"""The continuous loop's delta path (``continuous.deltas``): publish a pass as embedding deltas.

When a stack serves this model and ``RUN/export`` is the export of its default version (the
loop's last full publish), a due publish is a delta instead of an export + rollout:

1. ``training.export.delta``, in the loop's process: the checkpoint's rows whose int8 bytes differ from
   what the workers serve (the default's mapped tables + its chain), the dense weights, into
   ``<store>/deltas/<model>/<default>/``, gated in process on the arriving file's first
   ``rollout_eval_rows`` rows (rows the candidate never trained on) against what serves now:
   a lower AUC by more than the rollout's margin refuses it (the file removed);
2. ``python -m serving.tools.deltas publish``: the pointer moved, every worker of every
   replica acknowledging; ``continuous.delta_dwell_s`` > 0: the gateway's error gate, a
   failure rolled back.

Every ``continuous.compact_every`` deltas (the chain that long) the publish is a full export
+ rollout again (compaction): a new version, a new mapped file, an empty chain. The record in
``continuous.jsonl``: rows, bytes, the gate's AUCs, ``served_s`` (pointer -> every worker) and
``freshness_s`` (end of the pass -> every worker serving it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from recsys_model.delta import DeltaError, read_pointer
from training.checkpoint import store as checkpoint
from training.continuous.config import ContinuousConfig
from training.errors import RecsysError
from training.export.delta import gate, make_delta, unseen_arrays

MARGIN = 0.002  # AUC the candidate may lose against what serves (the rollout's default margin)


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


def publish_delta(
    cfg: ContinuousConfig, run_dir: Path, folder: Path, base: dict[str, Any], unseen: Path,
    pass_end: float,
) -> dict[str, Any]:  # fmt: skip
    """Make, gate and publish the delta of ``run_dir``'s latest checkpoint over ``folder``;
    the record (module doc)."""
    c = cfg.continuous
    record: dict[str, Any] = {**base, "event": "delta", "base": folder.name, "promoted": False}
    t0 = time.perf_counter()
    try:  # in this process (torch imported): the import is no part of the freshness
        ckpt = checkpoint.read_latest(run_dir / "checkpoints")
        if ckpt is None:
            raise DeltaError(f"{run_dir}: no checkpoint")
        delta, now, candidate = make_delta(ckpt, cfg.model, run_dir / "export", folder,
                                           base["version"])  # fmt: skip
        arrays = unseen_arrays(unseen, cfg, c.rollout_eval_rows)
        judged = gate(now, candidate, arrays, MARGIN)
    except (DeltaError, OSError, ValueError, RecsysError) as e:
        return {**record, "reason": f"delta not made: {e}"}
    record.update(rows=delta["rows"], bytes=delta["bytes"], gate=judged,
                  make_s=round(time.perf_counter() - t0, 2))  # fmt: skip
    if not judged["passed"]:
        (folder / delta["file"]).unlink(missing_ok=True)
        return {**record, "reason": "evaluated gate: the candidate's AUC is lower"}
    cmd = [sys.executable, "-m", "serving.tools.deltas", "publish", "--workdir",
           str(c.serve_dir), "--record", json.dumps(delta), "--dwell-s", str(c.delta_dwell_s)]  # fmt: skip
    moved = subprocess.run(cmd, capture_output=True, text=True)
    try:
        out = json.loads(moved.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {**record, "reason": moved.stderr.strip()[-500:] or f"exit {moved.returncode}"}
    record.update(promoted=bool(out.get("promoted")), served_s=out.get("served_s"),
                  workers=out.get("workers"), reason=out.get("reason"),
                  freshness_s=round(time.time() - pass_end, 2))  # fmt: skip
    return record
