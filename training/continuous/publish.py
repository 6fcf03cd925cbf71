"""Export a version of the run and, when a stack is serving, roll it out evaluated.

Both are the stage commands themselves (``python -m training.export``, ``python -m
serving.tools.rollout``), run as child processes of rank 0 while the other ranks wait with it
(:func:`on_rank0`: a short collective every few seconds, so no rank sits in one long wait).
Each outcome is one record in ``RUN/continuous.jsonl`` (``"event": "export"`` / ``"rollout"``)
and TensorBoard scalars (``rollout/promoted`` 1 or 0, ``rollout/auc_default``,
``rollout/auc_candidate``). A failed export or a refused candidate is recorded and the loop
goes on: the stack keeps serving what it served.

The stack is the one ``make serve`` recorded in ``continuous.serve_dir`` (``serve.json``,
``plan.json``): the version goes to its model store, and is rolled out when the plan serves
the same model name (``dlrm-<preset>``). The rollout compares the candidate with the served
default on the newest file, the one trained last (``--eval-data FILE --holdout 0``, at most
``continuous.rollout_eval_rows`` rows) with the rollout's own rules: its margin, and the
refusal when the default itself scores near chance there. The candidate has trained on
those rows once, so the gate stops a broken or regressed candidate; what freshness buys is
measured before training, by the progressive validation. (Not the newest file present: in a
backlog, the served model can be days older than it, and a stale model's NE above 1 there
would refuse every candidate as "data that does not fit the model".)
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from training.continuous.config import ContinuousConfig

logger = logging.getLogger("training.continuous")
POLL_S = 2.0


def on_rank0(fn: Callable[[], Any], rank: int) -> Any:
    """Run ``fn`` on rank 0 (in a thread) while every rank polls for its end with a short
    collective every :data:`POLL_S` seconds; its result, broadcast to all ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    box: list[Any] = [None]
    thread = None
    if rank == 0:
        thread = threading.Thread(target=lambda: box.__setitem__(0, fn()), daemon=True)
        thread.start()
    while True:
        done = [thread is not None and not thread.is_alive()]
        dist.broadcast_object_list(done, src=0)
        if done[0]:
            break
        time.sleep(POLL_S)
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _run(cmd: list[str]) -> tuple[int, str]:
    logger.info("running %s", " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr


def _last_error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    if lines:
        return lines[-1]
    tail = [line for line in output.splitlines() if line.strip()]
    return tail[-1] if tail else "(no output)"


def serving_stack(serve_dir: Path) -> tuple[str | None, Path | None]:
    """(model the running plan serves, the stack's model store), or Nones without a stack."""
    try:
        plan = json.loads((serve_dir / "plan.json").read_text())
        state = json.loads((serve_dir / "serve.json").read_text())
    except (OSError, ValueError):
        return None, None
    replicas = state.get("replicas") or [{}]
    store = replicas[0].get("torchserve", {}).get("model_store")
    return plan.get("model"), Path(store) if store else None


def publish(cfg: ContinuousConfig, run_dir: Path, step: int, newest: Path) -> list[dict[str, Any]]:
    """Export step ``step`` of ``run_dir`` as version ``<step>``, then roll it out if a stack
    serves this model; returns the records (export, and rollout when one ran)."""
    c = cfg.continuous
    name, version = f"dlrm-{cfg.name}", str(step)
    served_model, store = serving_stack(c.serve_dir) if c.rollout else (None, None)
    store = store or c.model_store
    mar = store / f"{name}-{version}.mar"
    records: list[dict[str, Any]] = []
    base = {"step": step, "version": version, "model": name, "time": time.time()}
    if mar.is_file():  # exported before a restart: do not export it twice
        records.append({**base, "event": "export", "ok": True, "mar": str(mar), "reused": True})
    else:
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "training.export", "--run-dir", str(run_dir),
               "--version", version, "--model-store", str(store), "--no-progress",
               *c.export_args]  # fmt: skip
        code, out = _run(cmd)
        record = {**base, "event": "export", "ok": code == 0, "mar": str(mar),
                  "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
        if code:
            record["error"] = _last_error(out)
        records.append(record)
        if code:
            return records
    if served_model is None:
        return records
    if served_model != name:
        records.append({**base, "event": "rollout", "promoted": False,
                        "reason": f"the stack serves {served_model}, not {name}"})  # fmt: skip
        return records
    records.append(rollout(cfg, version, newest, base))
    return records


def rollout(cfg: ContinuousConfig, version: str, newest: Path, base: dict[str, Any]) -> dict:
    """``python -m serving.tools.rollout --version V --eval-data NEWEST``; its report."""
    c = cfg.continuous
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "serving.tools.rollout", "--version", version,
           "--workdir", str(c.serve_dir), "--eval-data", str(newest), "--holdout", "0",
           "--eval-rows", str(c.rollout_eval_rows), "--no-progress", *c.rollout_args]  # fmt: skip
    code, out = _run(cmd)
    record: dict[str, Any] = {**base, "event": "rollout", "promoted": code == 0,
                              "eval_data": str(newest),
                              "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    report_line = [line for line in out.splitlines() if line.startswith("report: ")]
    report: dict[str, Any] = {}
    if report_line:
        try:
            report = json.loads(Path(report_line[-1][len("report: ") :]).read_text())
        except (OSError, ValueError):
            report = {}
    evaluation = report.get("evaluation", {})
    for who in ("default", "candidate"):
        if who in evaluation:
            record[f"auc_{who}"] = evaluation[who].get("auc")
    record["from"] = report.get("from")
    if code:
        refused = [line for line in out.splitlines() if line.startswith("refused")]
        record["reason"] = refused[-1] if refused else _last_error(out)
    return record
