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
the same model name (``dlrm-<preset>``). **What it is judged on**: the file that just arrived,
which no model has trained on yet (the loop publishes before training on it). The export
records it as the version's unseen rows (``--unseen-data``: schema.json ``data.unseen``, and
the parity rows), and the rollout takes its default rows, those the candidate never saw (at
most ``continuous.rollout_eval_rows``, the file's first), which the served default, an older
model, never saw either; the rollout checks that against the default's own record and says
so. The rows' source (file, row range, unseen by whom) is in the rollout's record. Its rules
stand: the margin, and the refusal when the default itself scores near chance there.

**Identity, not the name.** ``<name>-<step>.mar`` in the store is reused only when it is
this run's export of this checkpoint: each archive carries ``identity.json`` (added by this
module after the export: the run's id, a uuid made once per run directory and kept in
``RUN/run_id``, and the checkpoint's step and digest, :func:`checkpoint_identity`). A run
directory deleted and started again finds the earlier run's archive under the name and
exports its own as ``<step>-<run8>`` (then ``<step>-<run8>-<ckpt8>`` for a checkpoint re-saved
at the same step), with a warning and the collision in the record; an archive without the file
(another tool's, or an export killed before it was stamped) is never reused. A run in another
directory is refused the preset's model name when the store holds it from the first one (the
export's rule, :func:`training.export.archive.check_owner`): one line in the record, nothing
exported, the loop goes on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from training.checkpoint import store as checkpoint
from training.continuous.config import ContinuousConfig
from training.continuous.touched import Touched, chain_end
from training.errors import ConfigError
from training.export.archive import check_owner

logger = logging.getLogger("training.continuous")
POLL_S = 2.0
RUN_ID = "run_id"  # in the run directory: the run's uuid
IDENTITY = "identity.json"  # in the .mar: who exported it, from what
IDENTITY_KEYS = ("run_id", "step", "digest")  # what must match for a reuse


def from_rank0(value: Any) -> Any:
    """Rank 0's ``value`` on every rank."""
    box = [value]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


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


def run_id(run_dir: Path) -> str:
    """The run's id: a uuid made once per run directory, kept in ``RUN/run_id`` (a deleted
    and restarted run directory gets a new one; created with a link, never replaced)."""
    path = run_dir / RUN_ID
    if not path.is_file():
        run_dir.mkdir(parents=True, exist_ok=True)
        tmp = run_dir / f".{RUN_ID}.tmp-{os.getpid()}"
        tmp.write_text(uuid.uuid4().hex + "\n")
        with contextlib.suppress(FileExistsError):  # another process made it first: theirs
            os.link(tmp, path)
        tmp.unlink()
    text = path.read_text().strip()
    if not text:
        raise RuntimeError(f"{path} is empty: delete it (a new run id is made) and run again")
    return text


def checkpoint_identity(ckpt: Path) -> dict[str, Any]:
    """``{"step", "digest"}`` of a checkpoint directory: the sha256 of its ``meta.json``
    (progress, ledger, metrics and ``saved_at``: written anew by every save) and DCP's
    ``.metadata``, and of every file's name and size. Reads those two small files, not the
    shards: the step, the save and the shard layout tell one checkpoint from another."""
    h = hashlib.sha256()
    for p in sorted(ckpt.iterdir()):
        if p.is_file():
            h.update(f"{p.name}\0{p.stat().st_size}\0".encode())
            if p.name in (checkpoint.META, ".metadata"):
                h.update(p.read_bytes())
    step = int(checkpoint.read_meta(ckpt).get("progress", {}).get("step", -1))
    return {"step": step, "digest": h.hexdigest()}


def exported_identity(mar: Path) -> dict[str, Any] | None:
    """The ``identity.json`` a published ``.mar`` carries; None when it has none (or is not
    a readable archive)."""
    try:
        with zipfile.ZipFile(mar) as z:
            found = json.loads(z.read(IDENTITY))
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        return None
    return found if isinstance(found, dict) else None


def choose_version(
    store: Path, name: str, ident: dict[str, Any]
) -> tuple[str | None, bool, list[str]]:
    """``(version, reuse, collisions)``: the first of ``<step>``, ``<step>-<run8>``,
    ``<step>-<run8>-<ckpt8>`` whose ``.mar`` is absent (export it) or holds ``ident`` (reuse
    it); version None when each holds another model. ``collisions``: one line per name taken."""
    step, run8, ckpt8 = ident["step"], ident["run_id"][:8], ident["digest"][:8]
    collisions: list[str] = []
    for version in (str(step), f"{step}-{run8}", f"{step}-{run8}-{ckpt8}"):
        mar = store / f"{name}-{version}.mar"
        if not mar.is_file():
            return version, False, collisions
        found = exported_identity(mar)
        if found is not None and all(found.get(k) == ident[k] for k in IDENTITY_KEYS):
            return version, True, collisions
        who = (
            f"run {str(found.get('run_id'))[:8]}, checkpoint {str(found.get('digest'))[:8]}"
            if found else "no identity.json"
        )  # fmt: skip
        collisions.append(f"{mar} is another model ({who})")
    return None, False, collisions


def _stamp_and_place(built: Path, mar: Path, ident: dict[str, Any]) -> None:
    """Add ``identity.json`` to the archive built aside, then link it in under its name (an
    archive that appeared there meanwhile is never replaced)."""
    with zipfile.ZipFile(built, "a") as z:
        info = zipfile.ZipInfo(IDENTITY, time.localtime()[:6])
        info.external_attr = 0o644 << 16
        z.writestr(info, json.dumps(ident, indent=2), compress_type=zipfile.ZIP_DEFLATED)
    try:
        os.link(built, mar)
    except FileExistsError:
        raise RuntimeError(f"{mar} appeared during the export: not replaced") from None
    except OSError:  # a filesystem without hard links
        if mar.exists():
            raise RuntimeError(f"{mar} appeared during the export: not replaced") from None
        os.replace(built, mar)


def export(
    cfg: ContinuousConfig,
    run_dir: Path,
    step: int,
    store: Path,
    base: dict[str, Any],
    unseen: Path | None = None,
) -> dict[str, Any]:
    """Export ``run_dir``'s latest checkpoint (step ``step``) into ``store`` under a version
    that is this run's and this checkpoint's, or reuse the one exported before a restart
    (module doc), ``unseen`` recorded as rows it never trained on; the export record
    (``version`` and ``mar`` set)."""
    name = base["model"]
    ckpt = checkpoint.read_latest(run_dir / "checkpoints")
    if ckpt is None:
        return {**base, "event": "export", "ok": False, "error": f"{run_dir}: no checkpoint"}
    ident = {"run_id": run_id(run_dir), **checkpoint_identity(ckpt)}
    if ident["step"] != step:
        return {**base, "event": "export", "ok": False,
                "error": f"{ckpt} is step {ident['step']}, not {step}: not exported"}  # fmt: skip
    try:  # the export's rule, which it cannot apply to the staging folder it is given
        check_owner(store, name, run_dir)
    except ConfigError as e:
        return {**base, "event": "export", "ok": False, "error": f"error: {e}"}
    version, reuse, collisions = choose_version(store, name, ident)
    for line in collisions:
        logger.warning("%s: exporting this run's step %d under another version", line, step)
    record: dict[str, Any] = {**base, "event": "export", "version": version,
                              "run_id": ident["run_id"], "checkpoint_digest": ident["digest"]}  # fmt: skip
    if unseen is not None:
        record["unseen"] = str(unseen)
    if collisions:
        record["collisions"] = collisions
    if version is None:
        record.update(ok=False, error=f"{'; '.join(collisions)}: step {step} not exported: "
                      f"remove those archives or set continuous.model_store")  # fmt: skip
        return record
    mar = store / f"{name}-{version}.mar"
    record["mar"] = str(mar)
    if reuse:  # this run's export of this checkpoint, from before a restart
        return {**record, "ok": True, "reused": True}
    t0 = time.perf_counter()
    staging = store / f".publish-{os.getpid()}"  # built aside, stamped, then linked in
    shutil.rmtree(staging, ignore_errors=True)
    cmd = [sys.executable, "-m", "training.export", "--run-dir", str(run_dir),
           "--checkpoint", str(ckpt), "--version", version, "--model-store", str(staging),
           "--no-progress", "--name", name, *(["--unseen-data", str(unseen)] if unseen else []),
           *cfg.continuous.export_args]  # fmt: skip
    try:
        code, out = _run(cmd)
        if code == 0:
            try:
                _stamp_and_place(staging / mar.name, mar, {**ident, "checkpoint": str(ckpt)})
            except (OSError, RuntimeError, zipfile.BadZipFile) as e:
                code, out = 1, f"error: {e}"
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    record.update(ok=code == 0, seconds=round(time.perf_counter() - t0, 1))
    if code:
        record["error"] = _last_error(out)
    return record


def publish(
    cfg: ContinuousConfig, run_dir: Path, step: int, unseen: Path, pass_end: float = 0.0,
    touched: Touched | None = None, early: Any = None,
) -> list[dict[str, Any]]:  # fmt: skip
    """Export step ``step`` of ``run_dir`` as version ``<step>`` (another when that name is
    another model's: module doc), ``unseen`` its rows never trained on, then roll it out if a
    stack serves this model; returns the records (export, and rollout when one ran).
    ``touched``: the rows trained since what serves, restarted at what this publish serves;
    ``early``: the delta made while the loop scored ``unseen`` (:class:`.deltas.Early`)."""
    c = cfg.continuous
    name = f"dlrm-{cfg.name}"
    from training.continuous.deltas import served_store, try_delta

    served_model, store, deltas_ok = served_store(c, name)
    base = {"step": step, "version": str(step), "model": name, "time": time.time()}
    records: list[dict[str, Any]] = []
    if deltas_ok:
        delta = try_delta(cfg, run_dir, store, base, unseen, pass_end or time.time(), touched,
                          early)  # fmt: skip
        records += [delta] if delta else []
        if delta and not delta.get("fallback"):  # served, or refused by the evaluated gate
            return records
    record = export(cfg, run_dir, step, store, base, unseen)
    records.append(record)
    if not record["ok"]:
        return records
    if touched is not None and store is not None:  # a delta's base from now on: this export
        folder = Path(store).resolve() / "deltas" / name / str(record["version"])
        touched.restart(chain_end(folder, []), step)
    version = str(record["version"])
    base = {**base, "version": version}
    if served_model is None:
        return records
    if served_model != name:
        records.append({**base, "event": "rollout", "promoted": False,
                        "reason": f"the stack serves {served_model}, not {name}"})  # fmt: skip
        return records
    rolled = rollout(cfg, version, base)
    if rolled["promoted"] and pass_end:  # end of the pass -> the rollout command's end
        rolled["freshness_s"] = round(time.time() - pass_end, 2)
    records.append(rolled)
    return records


def rollout(cfg: ContinuousConfig, version: str, base: dict[str, Any]) -> dict[str, Any]:
    """``python -m serving.tools.rollout --version V`` on the candidate's own unseen rows (its
    default, module doc); its report, with the rows' source."""
    c = cfg.continuous
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "serving.tools.rollout", "--version", version,
           "--workdir", str(c.serve_dir), "--eval-rows", str(c.rollout_eval_rows),
           "--no-progress", *c.rollout_args]  # fmt: skip
    code, out = _run(cmd)
    record: dict[str, Any] = {**base, "event": "rollout", "promoted": code == 0,
                              "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
    return {**record, **rollout_outcome(code, out)}


def rollout_outcome(code: int, out: str) -> dict[str, Any]:
    """What the record keeps of a rollout command's exit ``code`` and output ``out`` (its
    report file, named on its ``report:`` line): both versions' AUC, the rows they were
    compared on (``eval``: files, row range, unseen by whom), the default it ran against, and
    why it was refused."""
    report_line = [line for line in out.splitlines() if line.startswith("report: ")]
    report: dict[str, Any] = {}
    if report_line:
        try:
            report = json.loads(Path(report_line[-1][len("report: ") :]).read_text())
        except (OSError, ValueError):
            report = {}
    evaluation = report.get("evaluation", {})
    record: dict[str, Any] = {}
    for who in ("default", "candidate"):
        if who in evaluation:
            record[f"auc_{who}"] = evaluation[who].get("auc")
    if "source" in evaluation:
        record["eval"] = evaluation["source"]
    record["from"] = report.get("from")
    if code:
        refused = [line for line in out.splitlines() if line.startswith("refused")]
        record["reason"] = refused[-1] if refused else _last_error(out)
    return record
