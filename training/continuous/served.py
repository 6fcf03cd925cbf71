"""What the loop does with a publish's outcome, and the served version's checkpoint.

**Outcomes.** Each publish (:meth:`Continuous.publish`: an export and its rollout, or a delta)
is one of: *published* (exported; promoted when a stack judged it), *refused* (the gate said
no: the rollout's evaluation or error gate, the delta's gate), *not rolled out* (exported, but
the stack serves another model) or *failed* (no export, no delta, or a rollout that broke).
A failure and a not-rolled-out are a WARNING with the fix (the record in ``continuous.jsonl``
gets it as ``"fix"``), all four are counted in the run's final JSON (``"publish"``), and a run
whose every publish failed exits 3 (torchrun then 1; ``continuous.require_publish = false``: 0).

**The model's name** is ``dlrm-<name>`` of the loop's config (``--name``, recorded in the
run's checkpoints, kept by later runs); the loop passes it to the export. A store holding that
name from another run refuses it (:func:`training.export.archive.check_owner`): the fix is a
name of this run's own, ``CONTINUOUS_ARGS='--name X'`` (``make export NAME=`` is the export's
own flag, and ``continuous.export_args`` cannot rename what the loop publishes).

**After a refusal** on the figures (the candidate's AUC below the default's, or a delta's gate)
the next pass starts from the served version's weights (``continuous.after_refusal =
"served"``): its checkpoint is pinned in ``RUN/served/`` (hard links of the checkpoint's
files, one version) at each promotion, so that ``train.keep_last`` cannot prune it; a served
version the loop never promoted is found through its archive (``identity.json``'s checkpoint)
or the run's ``checkpoints/step_<version>``. The step count goes on (the next version is
named by it), the ledger too: only the weights and the optimizer's state are the served ones.
``"candidate"``: training goes on from the refused weights, as before.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

from training.checkpoint import store as checkpoint
from training.continuous.config import serving_stack
from training.continuous.publish import (
    exported_identity,
    from_rank0,
    run_id,
)

Continuous = Any  # training.continuous.file_loop.Continuous (not imported: it imports this)

logger = logging.getLogger("training.continuous")
PIN = "served"  # RUN/served/step_<n>: the served version's checkpoint (module doc)
EXIT_UNPUBLISHED = 3
OWNER_REFUSALS = ("from another run", "cannot tell which run")


def step_of(version: Any) -> int | None:
    """A version's checkpoint step: ``"195"``, ``"195-<run8>"`` -> 195; None otherwise."""
    head = str(version or "").split("-", 1)[0]
    return int(head) if head.isdigit() else None


def pinned(run_dir: Path) -> Path | None:
    """The pinned checkpoint of the served version, None when there is none."""
    root = run_dir / PIN
    found = [p for p in sorted(root.glob("step_*")) if checkpoint.is_complete(p)]
    return found[-1] if found else None


def pin(run_dir: Path, ckpt: Path) -> Path:
    """Keep ``ckpt`` as the served version's checkpoint (rank 0): hard links of its files
    (copies where links fail), placed by a rename, the previous pin removed."""
    root = run_dir / PIN
    final = root / ckpt.name
    if final.resolve() == ckpt.resolve() or checkpoint.is_complete(final):
        return final
    tmp = root / f".{ckpt.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(ckpt, tmp, copy_function=link)
    os.replace(tmp, final)
    for old in root.glob("step_*"):
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    return final


def _store(loop: Continuous) -> Path:
    _, store = serving_stack(loop.c.serve_dir) if loop.c.rollout else (None, None)
    return store or loop.c.model_store


def served_checkpoint(loop: Continuous, version: str | None = None) -> Path | None:
    """(rank 0) The checkpoint of the served ``version`` (default: the default of the stack's
    plan when it serves this model; else the pin): the pin when it is that step, else the
    archive's, else the run's own ``step_<n>`` (a version of this run, or of no identity; pinned
    then); None when none is found."""
    name = f"dlrm-{loop.cfg.name}"
    if version is None and loop.c.deltas and pinned(loop.run_dir) is not None:
        return pinned(loop.run_dir)  # the base's deltas on top: the last promoted, pinned
    if version is None:
        model, _ = serving_stack(loop.c.serve_dir) if loop.c.rollout else (None, None)
        if model == name:
            try:
                version = str(json.loads((loop.c.serve_dir / "plan.json").read_text())["default"])
            except (OSError, ValueError, KeyError):
                version = None
    here = pinned(loop.run_dir)
    step = step_of(version)
    if version is None or (here is not None and _step_in(here) == step):
        return here
    found = exported_identity(_store(loop) / f"{name}-{version}.mar") or {}
    candidates = [Path(found["checkpoint"])] if found.get("checkpoint") else []
    if step is not None and found.get("run_id", run_id(loop.run_dir)) == run_id(loop.run_dir):
        candidates.append(loop.run_dir / "checkpoints" / checkpoint.step_dir_name(step))
    for ckpt in candidates:
        if checkpoint.is_complete(ckpt):
            return pin(loop.run_dir, ckpt)
    return None


def _step_in(ckpt: Path) -> int:
    return int(checkpoint.read_meta(ckpt).get("progress", {}).get("step", -1))


def load_weights(loop: Continuous, ckpt: Path) -> None:
    """Load ``ckpt``'s model and optimizer state into the trainer (collective); the progress,
    the ledger and the logs stay the run's."""
    state, _ = checkpoint.load(ckpt, loop.trainer.state_dict(), loop.checkpointer.table_rows)
    loop.trainer.load_state_dict(state)


def suggest_name(loop: Continuous, store: Path) -> str:
    """A name for this run's model that ``store`` does not hold: the run directory's, else
    with the run's id."""
    run = loop.run_dir.resolve().name
    for cand in (run, f"{run}-{run_id(loop.run_dir)[:8]}"):
        if cand != loop.cfg.name and not any(store.glob(f"dlrm-{cand}-*.mar")):
            return cand
    return f"{run}-{int(time.time())}"


class Outcomes:
    """The loop's publish outcomes: warnings, fixes, counts, pins, the weights after a
    refusal (module doc)."""

    def __init__(self, loop: Continuous) -> None:
        self.loop = loop
        self.counts = {"publishes": 0, "published": 0, "refused": 0, "not_rolled_out": 0,
                       "failed": 0}  # fmt: skip
        self.weights_from: int | None = None  # the step whose weights the next pass starts from
        self.fixes: list[str] = []

    # -- what one publish was ------------------------------------------------------------------

    @staticmethod
    def kind(records: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
        """``(outcome, the record that decided it)``: published, refused, not_rolled_out or
        failed (module doc)."""
        last = records[-1]
        if last["event"] == "delta":
            if last.get("promoted"):
                return "published", last
            gate = last.get("gate")
            refused = isinstance(gate, dict) and gate.get("passed") is False
            return ("refused" if refused else "failed"), last
        if last["event"] == "export":
            return ("published" if last.get("ok") else "failed"), last
        if last.get("promoted"):
            return "published", last
        reason = str(last.get("reason") or "")
        if reason.startswith("the stack serves"):
            return "not_rolled_out", last
        return ("refused" if reason.startswith("refused") else "failed"), last

    @staticmethod
    def on_figures(record: dict[str, Any]) -> bool:
        """Whether a refusal is the gate's judgement of the candidate's figures (its AUC below
        the default's, or a delta's gate), not of the traffic or the infrastructure."""
        if record["event"] == "delta":
            return True
        cand, default = record.get("auc_candidate"), record.get("auc_default")
        return isinstance(cand, float | int) and isinstance(default, float | int) and cand < default

    def fix(self, outcome: str, record: dict[str, Any]) -> str:
        """The fix of a failed or not-rolled-out publish, for this loop."""
        loop, name = self.loop, f"dlrm-{self.loop.cfg.name}"
        if outcome == "not_rolled_out":
            return (
                f"{record.get('reason')}: this loop publishes {name}; serve it (make stop; make "
                f"serve RUN={loop.run_dir}), or run the loop of the served model's run, or "
                "continuous.rollout=false to export only"
            )
        error = str(record.get("error") or record.get("reason") or "")
        if any(s in error for s in OWNER_REFUSALS):
            store = _store(loop)
            new = suggest_name(loop, store)
            return (
                f"{store} holds {name} from another run: give this run's model its own name, "
                f"make continuous RUN={loop.run_dir} CONTINUOUS_ARGS='--name {new}' (= --name "
                f"{new}: the model becomes dlrm-{new}, kept by the run's checkpoints; make "
                "export NAME= and continuous.export_args do not rename what the loop publishes)"
            )
        return f"{error or 'no error recorded'} (the record in {loop.run_dir}/continuous.jsonl)"

    def annotate(self, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``records``, with ``"fix"`` added to the deciding record of a failed or
        not-rolled-out publish (every rank: the records are rank 0's, broadcast)."""
        outcome, record = self.kind(records)
        if outcome in ("failed", "not_rolled_out"):
            record["fix"] = self.fix(outcome, record)
        return records

    # -- what the loop does with it ------------------------------------------------------------

    def after(self, records: list[dict[str, Any]]) -> None:
        """Count, warn, pin a promoted version, and after a refusal on the figures load the
        served version's weights (``continuous.after_refusal``); collective."""
        loop = self.loop
        outcome, record = self.kind(records)
        self.counts["publishes"] += 1
        self.counts[outcome] += 1
        say = loop.rank == 0
        version, step = record.get("version"), record.get("step")
        if outcome in ("failed", "not_rolled_out"):
            self.fixes.append(record["fix"])
            if say:
                what = "failed" if outcome == "failed" else "exported, not rolled out"
                logger.warning("publish of step %s (v%s) %s: fix: %s", step, version, what,
                               record["fix"])  # fmt: skip
        elif outcome == "published" and record.get("promoted") and say:
            ckpt = loop.run_dir / "checkpoints" / checkpoint.step_dir_name(int(record["step"]))
            if checkpoint.is_complete(ckpt):
                pin(loop.run_dir, ckpt)
        elif outcome == "refused":
            if say:
                logger.warning("v%s refused: %s", version, record.get("reason"))
            if self.on_figures(record):
                self.after_refusal(record)

    def after_refusal(self, record: dict[str, Any]) -> None:
        """The next pass's weights after ``record``'s refusal (module doc); one line."""
        loop = self.loop
        cand = record.get("version")
        if loop.c.after_refusal == "candidate":
            if loop.rank == 0:
                logger.warning("v%s refused: training goes on from its weights "
                               "(continuous.after_refusal=candidate)", cand)  # fmt: skip
            return
        served = record.get("from") if record["event"] == "rollout" else None
        found = None
        if loop.rank == 0:  # a delta's: the pin (the chain's last promoted), else the base
            path = pinned(loop.run_dir) if served is None else None
            path = path or served_checkpoint(loop, served)
            found = None if path is None else (str(path), _step_in(path))
        found = from_rank0(found)
        if found is None:
            if loop.rank == 0:
                logger.warning("v%s refused, and the served version's checkpoint is not found "
                               "(%s/served/, its archive, checkpoints/): training goes on from "
                               "the refused weights", cand, loop.run_dir)  # fmt: skip
            return
        path, step = found
        load_weights(loop, Path(path))
        self.weights_from = step
        if loop.rank == 0:
            logger.warning("v%s refused: the next pass starts from the served version's weights "
                           "(%s, step %d), not the refused ones (continuous.after_refusal="
                           "candidate keeps them)", cand, path, step)  # fmt: skip

    def resume(self) -> None:
        """At the start: a refusal the log shows at the checkpoint's step (the run stopped
        after it, before its next checkpoint) has its weights loaded again."""
        loop = self.loop
        found = None
        if loop.rank == 0 and loop.c.after_refusal == "served":
            step = loop.progress.step
            events = loop._records(loop.run_dir / "continuous.jsonl")
            mine = [e for e in events if e.get("step") == step
                    and e.get("event") in ("export", "rollout", "delta")]  # fmt: skip
            if mine:
                outcome, record = self.kind(mine)
                if outcome == "refused" and self.on_figures(record):
                    found = record
        found = from_rank0(found)
        if found is not None:
            self.after_refusal(found)

    def file_fields(self) -> dict[str, Any]:
        """For the file's record: the step whose weights its pass started from, after a
        refusal (then cleared)."""
        out = {} if self.weights_from is None else {"weights_from": self.weights_from}
        self.weights_from = None
        return out

    def summary(self) -> dict[str, Any]:
        return {"publish": dict(self.counts)}

    def exit_code(self) -> int:
        """3 when every publish failed (``continuous.require_publish``), else 0."""
        n = self.counts["publishes"]
        if self.loop.c.require_publish and n and self.counts["failed"] == n:
            return EXIT_UNPUBLISHED
        return 0
