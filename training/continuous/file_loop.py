"""The continuous loop: score each arriving file, publish what it is news to, train on it.

Every rank runs the same loop in the same process group (any number of processes); rank 0
looks at the data folder and preprocesses each file while the others wait for its outcome
(broadcast), so every rank takes the same file, or the same rejection, at the same time.
The per-file schedule:

1. **load**: the file's binary cache (:func:`training.data.binary.ensure_binary`, ids hashed
   for the model's tables); a file failing the malformed-row policy, or too short for one
   global batch, is moved to ``rejected/`` with its reason (:mod:`training.continuous.inbox`);
2. **progressive validation**: AUC, NE, calibration of the current model on the file (its
   first ``continuous.progressive_rows``, default all) before any of it is trained, one record
   in ``RUN/progressive.jsonl`` and ``progressive/*`` in TensorBoard (step = the file's number);
   a file whose label rate or AUC is far off the recent files' is quarantined (:mod:`.poison`);
3. **publish**, every ``continuous.export_every`` files trained (:mod:`.publish`): the model
   trained up to the previous file is exported with this file as the rows it never saw
   (schema.json, parity) and rolled out judged on them, the served default beside it, before
   any model trains on them (progressive validation as the gate: docs/operating.md); after
   a refusal the next pass starts from the served version's weights (:mod:`.served`);
4. **train** one pass: the rows carried from the previous file first, then the file's own, each
   in a shuffled order of its own (seed: the run's and the file's number; :mod:`.carry`),
   checkpointing every ``continuous.checkpoint_every`` steps and at the end with the ledger
   (file, row position, trained segments, rows carried in and out) in ``meta.json``: a run
   killed mid-file resumes at the last checkpoint's row, its progressive record not redone;
   the last rows of the order, fewer than a global batch, are carried to the next file.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from training.checkpoint import store as checkpoint
from training.checkpoint.checkpointer import Checkpointer
from training.config import config_to_dict
from training.continuous import carry, deltas, inbox
from training.continuous.config import ContinuousArgs, training_config
from training.continuous.inbox import FileRecord, Ledger
from training.continuous.poison import Guard
from training.continuous.publish import from_rank0, on_rank0, publish, run_id
from training.continuous.served import Outcomes
from training.data.loader import Arrays, Joined
from training.errors import DataError, RecsysError
from training.metrics import baseline
from training.metrics.evaluator import evaluate
from training.metrics.log import MetricsLog, read_metrics
from training.metrics.tb import Scalars
from training.metrics.tb import for_run as scalars_for_run
from training.train import make_loop
from training.trainer import Trainer, build_trainer, unwrapped_model

logger = logging.getLogger("training")
# Fault injection for the kill-mid-file test: the last rank SIGKILLs itself after this step.
KILL_AT_STEP_ENV = "RECSYS_TEST_KILL_AT_STEP"
PROGRESSIVE = "progressive.jsonl"
EVENTS = "continuous.jsonl"


class Continuous:
    """The loop's state on one rank: trainer, progress, ledger, logs (see the module doc)."""

    def __init__(self, args: ContinuousArgs, rank: int, world: int, device: torch.device):
        cfg, self.run_dir = args.config, args.run_dir
        self.cfg, self.c, self.rank, self.world = cfg, cfg.continuous, rank, world
        self.device = device
        self.show_bar = rank == 0 and args.progress
        self.data_dir = Path(self.c.data_dir)
        if cfg.train.batch_size % world:
            raise DataError(
                f"train.batch_size = {cfg.train.batch_size} is not divisible by {world} processes"
            )
        resume_from = checkpoint.resolve(args.resume, self.run_dir / "checkpoints")
        meta = checkpoint.read_meta(resume_from) if resume_from else None
        if resume_from and meta:
            checkpoint.check_compatible(resume_from, meta, config_to_dict(cfg)["model"])
        self.trainer: Trainer = build_trainer(cfg, device)
        self.progress = checkpoint.Progress()
        self.meta: dict[str, Any] = {"config": training_config(cfg, None), "world_size": world,
                                     "data": {}, "versions": {"torch": torch.__version__}}  # fmt: skip
        # the linear baseline (rank 0): scored beside the model, fitted on what it trained
        on_0 = cfg.baseline.enabled and rank == 0
        self.baseline = baseline.from_config(cfg.baseline) if on_0 else None
        self.checkpointer = Checkpointer(
            self.run_dir / "checkpoints", self.trainer, self.progress, cfg, self.meta,
            files=self.baseline.save if self.baseline else None,
        )  # fmt: skip
        self.ledger = Ledger()
        if resume_from is not None:
            assert meta is not None
            self.checkpointer.restore(resume_from, meta, rank)
            self.ledger = Ledger.from_json(meta.get("continuous"))
            if self.baseline is not None and not self.baseline.load(resume_from):
                logger.info("%s holds no baseline: it starts afresh", resume_from)
        elif rank == 0:
            logger.info("%s: no checkpoint, a fresh model from the config", self.run_dir)
        if rank == 0:
            run_id(self.run_dir)  # made once per run directory: who its archives are from
        step = self.progress.step
        self.tb: Scalars = scalars_for_run(self.run_dir, rank, step)
        on0 = rank == 0
        self.loss_log = MetricsLog(self.run_dir / "train_loss.jsonl", on0, self.tb, "train")
        self.progressive = MetricsLog(self.run_dir / PROGRESSIVE, on0)
        self.events = MetricsLog(self.run_dir / EVENTS, on0)
        for log in (self.loss_log, self.progressive, self.events):
            log.truncate_after(step)  # work a killed run did past its checkpoint is redone
        # per-file scalars (progressive/*, rollout/*: step = file number), never purged
        self.tb_files = Scalars(self.run_dir / "tb" / "files", enabled=on0)
        self.pipeline: Any = None
        self.last_metrics: dict[str, Any] = {}
        self.file_stats: dict[str, Any] = {}
        self.pass_end = 0.0  # when the last pass ended, checkpoint written (a delta's clock)
        self.guard, self.outcomes = Guard(self), Outcomes(self)  # quarantine; publish outcomes
        self.prefetch = inbox.Prefetch(rank == 0)  # the next file parsed during a pass
        self.early = deltas.Early(self)  # the delta made while the file it needs is scored
        self.touched = deltas.prepare(self.run_dir, cfg, step, rank)  # what a delta compares

    # -- files -----------------------------------------------------------------------------

    def next_file(self) -> str | None:
        """Rank 0's choice, on every rank: the file in progress, else the first pending one."""
        current = self.ledger.current
        if current is not None:
            return current.file
        name = None
        if self.rank == 0:
            files = inbox.pending(self.data_dir, self.ledger.consumed)
            name = files[0].name if files else None
        return from_rank0(name)  # type: ignore[no-any-return]

    def load(self, path: Path) -> tuple[Arrays | None, str, dict[str, Any]]:
        """(the file's rows, "", data info) or (None, why it is rejected, {})."""
        from training.data.binary import ensure_binary, load_binary

        d = self.cfg.data
        outcome: tuple[str, str] = ("", "")
        if self.rank == 0:
            self.prefetch.join()
            try:
                out_dir, _ = ensure_binary(
                    [path], Path(d.cache_dir), on_bad=d.on_bad_row, max_bad_rows=d.max_bad_rows,
                    progress=self.show_bar, rows_per_table=self.cfg.model.rows(),
                    processes=d.preprocess_processes,
                )  # fmt: skip
                outcome = ("ok", str(out_dir))
            except RecsysError as e:
                outcome = ("rejected", str(e))
        kind, text = from_rank0(outcome)
        if kind != "ok":
            return None, text, {}
        data = load_binary(Path(text))
        tables = data.meta.rows_per_table
        arrays = Arrays(data.labels, data.dense, data.sparse, data.prob,
                        None if tables is None else tuple(tables))  # fmt: skip
        need = self.cfg.train.batch_size if self.c.learn else 1
        if len(arrays) < need or len(set(arrays.labels[:100_000].tolist())) < 2:
            why = f"{len(arrays)} usable rows: too few for one batch of {need} rows, or a single label"
            return None, why, {}
        built_from = data.meta.inputs[0]  # the content the cache holds: what is trained
        info = {"source": str(path), "binary": text, "rows": len(arrays),
                "train_rows": len(arrays), "eval_rows": 0, "parse_report": data.meta.parse_report,
                "content": {k: built_from.get(k) for k in ("bytes", "sha256_ends")}}  # fmt: skip
        return arrays, "", info

    def in_progress(self, name: str, content: dict[str, Any]) -> FileRecord | None:
        """The ledger's file in progress when it still holds the bytes it was started on;
        replaced meanwhile, it is closed with the rows it had (the rest are gone) and None
        returned: the new content starts as a new file (inbox module doc)."""
        current = self.ledger.current
        if current is None or current.content in (None, content):
            return current
        if self.rank == 0:
            logger.warning("%s: replaced while in progress (%d of %d rows trained; %s, now %s): "
                           "the rest of the old file is not trained, its new content is a new "
                           "file", name, current.row, current.rows, current.content, content)  # fmt: skip
        current.done = True
        return None

    # -- progressive validation --------------------------------------------------------------

    def model(self) -> torch.nn.Module:
        if self.pipeline is None:
            return self.trainer.model
        return unwrapped_model(self.pipeline, self.trainer)

    def validate(self, record: FileRecord, arrays: Arrays) -> None:
        """Score the file before training on it, once (a resumed file keeps its record)."""
        done = self.rank == 0 and any(  # this file: its name may come back with other bytes
            r.get("file") == record.file and r.get("file_index", record.index) == record.index
            for r in self._records(self.run_dir / PROGRESSIVE)
        )
        if from_rank0(done):
            return
        n = self.c.progressive_rows
        rows = arrays.rows(0, min(n, len(arrays))) if n else arrays
        t0 = time.perf_counter()
        m = evaluate(self.model(), rows, self.cfg, self.rank, self.world)
        rec: dict[str, Any] = {"file": record.file, "rows": m["eval_rows"], "auc": m["auc"],
                               "ne": m["ne"], "calibration": m["calibration"],
                               "step": self.progress.step, "file_index": record.index,
                               "learn": self.c.learn, "label_rate": float(arrays.labels.mean()),
                               "seconds": round(time.perf_counter() - t0, 2)}  # fmt: skip
        rec.update({k: m[k] for k in ("oracle_auc",) if k in m})
        if self.baseline is not None and self.baseline.rows_seen:  # on the same rows
            rec.update(baseline.score(self.baseline, rows))
            for warning in baseline.judge({**rec, "eval_rows": rec["rows"]}):
                logger.warning("%s: %s", record.file, warning)
        self.progressive.write(rec)
        names = ("auc", "ne", "calibration", "oracle_auc", "baseline_auc", "baseline_ne")
        self.tb_files.add("progressive", {k: rec[k] for k in names if k in rec}, record.index)
        self.last_metrics = rec
        if self.rank == 0:
            logger.info("%s: progressive AUC %.4f  NE %.4f  calibration %.4f  (%d rows, step %d)",
                        record.file, rec["auc"], rec["ne"], rec["calibration"], rec["rows"],
                        rec["step"])  # fmt: skip

    @staticmethod
    def _records(path: Path) -> list[dict[str, Any]]:
        return read_metrics(path) if path.is_file() else []

    # -- training ----------------------------------------------------------------------------

    def save(self, path: Path, info: dict[str, Any]) -> None:
        self.meta["config"] = training_config(self.cfg, path)
        self.meta["data"] = info
        self.meta["continuous"] = self.ledger.to_json()
        self.checkpointer.save(self.last_metrics)

    def train(self, record: FileRecord, arrays: Arrays, path: Path, info: dict[str, Any]) -> None:
        """One pass over the carried rows then ``arrays`` from ``record.row``, checkpointing
        with the position; the last rows of the order, fewer than a batch, carried out."""
        cfg, g = self.cfg, self.cfg.train.batch_size
        head = carry.carried_in(self.run_dir, record, self.ledger.done, self.rank == 0)
        rows: Arrays | Joined = arrays if head is None else Joined(head, arrays)
        self.touched.add(head, arrays)  # before the pass: a restart finds them (.touched)
        self.prefetch.start(self.data_dir, self.ledger, record.file, cfg)
        stream = carry.FileStream(
            rows, record.carried_in, global_batch=g, rank=self.rank, world_size=self.world,
            rows_per_table=cfg.model.rows(), seed=cfg.train.seed,
            epochs=record.index + 1, start_epoch=record.index, start_row=record.row,
        )  # fmt: skip
        steps = (len(rows) - record.row) // g
        self.progress.epoch, self.progress.rows_in_epoch = record.index, record.row
        step0, row0 = self.progress.step, record.row
        record.begin(step0)
        if self.rank == 0 and record.row:
            logger.info("%s: resuming at row %d of %d (step %d)", record.file, record.row,
                        len(rows), step0)  # fmt: skip
        loop = make_loop(cfg, self.trainer, self.device, stream, self.progress, step0 + steps,
                         self.loss_log, self.show_bar)  # fmt: skip
        self.pipeline = loop.pipeline
        kill_at, start = int(os.environ.get(KILL_AT_STEP_ENV, "-1")), row0
        while self.progress.step < loop.total and loop.step():
            step = self.progress.step
            if step == kill_at and self.rank == self.world - 1:
                logger.warning("%s: killing rank %d after step %d", KILL_AT_STEP_ENV,
                               self.rank, step)  # fmt: skip
                os.kill(os.getpid(), signal.SIGKILL)
            every = self.c.checkpoint_every
            if every and step % every == 0 and step < loop.total:
                loop.window.flush()
                row = row0 + (step - step0) * g
                record.advance(start, row, step)
                start = row
                with loop.window.excluded():
                    self.save(path, info)
        loop.bar.close()
        rate = loop.window.samples_per_sec()
        record.advance(start, row0 + (self.progress.step - step0) * g, self.progress.step)
        carry.carry_out(self.run_dir, record, stream, rows, self.rank == 0)
        if self.baseline is not None:  # the rows the model trained, in its order: carried first
            trained = stream.order(record.index)[: record.row]
            n_head = 0 if head is None else len(head)
            if head is not None:
                self.baseline.fit(head, trained[trained < n_head])
            self.baseline.fit(arrays, trained[trained >= n_head] - n_head)
        self.file_stats = {"samples_per_sec": round(rate, 1) if rate else None,
                           "train_loss": loop.window.loss_sum / loop.window.steps
                           if loop.window.steps else None}  # fmt: skip

    # -- the loop ----------------------------------------------------------------------------

    def publish(self, unseen: Path) -> None:
        """Export the current step, with ``unseen`` (the file that arrived, not trained yet) as
        the rows it never saw, and roll it out judged on them against the served default."""
        step = self.progress.step
        index = len(self.ledger.done) - 1  # the file number it follows

        def work() -> list[dict[str, Any]]:
            try:
                return publish(self.cfg, self.run_dir, step, unseen, self.pass_end, self.touched,
                               self.early)  # fmt: skip
            except Exception as e:  # recorded; the loop goes on
                return [{"event": "export", "ok": False, "step": step, "error": repr(e)}]

        done = [f.file for f in self.ledger.done]
        records = self.outcomes.annotate(on_rank0(work, self.rank))  # a failure's fix (.served)
        for r in records:
            r["after"] = done[-1] if done else None  # the file it was trained up to
            self.events.write(r)
            if self.rank == 0:
                logger.info("%s", {k: v for k, v in r.items() if k != "time"})
            if r["event"] == "rollout":
                nums = {"promoted": float(bool(r.get("promoted")))}
                nums |= {k: r[k] for k in ("auc_default", "auc_candidate") if r.get(k) is not None}
                self.tb_files.add("rollout", nums, index)
        self.outcomes.after(records)  # warned, counted; after a refusal: the served weights
        if deltas.counted(records):  # a refused delta is no publish: the next file tries again
            self.ledger.files_since_export, self.ledger.exported_step = 0, step

    def due(self) -> bool:
        every = self.c.export_every
        return self.c.learn and bool(every) and self.ledger.files_since_export >= every

    def published(self) -> None:
        """At the start: a publish the checkpoint says is due, that the log shows done (the
        run was stopped after it, before its next checkpoint), is not done again; one not
        done waits for the next file, the rows it will be judged on."""
        step = self.progress.step
        events = self._records(self.run_dir / EVENTS) if self.rank == 0 else []
        logged = deltas.counted([e for e in events if e.get("step") == step])
        if from_rank0(logged):
            self.ledger.files_since_export, self.ledger.exported_step = 0, step

    def run(self) -> dict[str, Any]:
        """Files until none is left (or ``max_files``), polling when following."""
        c, done = self.c, 0
        if self.due():
            self.published()
        self.outcomes.resume()
        while not (c.max_files and done >= c.max_files):
            name = self.next_file()
            if name is None:
                if not c.follow:
                    break
                time.sleep(c.poll_s)
                continue
            path = self.data_dir / name
            arrays, reason, info = self.load(path)
            if arrays is None:
                inbox.reject_file(self, name, reason)
                continue
            record = self.in_progress(name, info["content"]) or self.ledger.start(
                name, len(arrays), info["content"]
            )
            self.early.start(path)  # (a delta due at this file, made while it is scored)
            self.validate(record, arrays)
            if self.guard.check(record, arrays, info):  # quarantined (.poison): the next file
                continue
            if self.due():  # the model before this file, judged on it: rows no model saw
                self.publish(path)
            t0 = time.perf_counter()
            self.file_stats = {}
            if c.learn:
                self.train(record, arrays, path, info)
            record.done = True
            self.ledger.files_since_export += 1
            self.save(path, info)
            self.pass_end = time.time()
            done += 1
            self.events.write({
                "event": "file", "file": name, "rows": record.rows, "trained_rows": record.row,
                "carried_in": record.carried_in, "carried_out": record.carried_out,
                "segments": record.segments, "step": self.progress.step,
                "seconds": round(time.perf_counter() - t0, 1), **self.file_stats,
                **self.outcomes.file_fields(),
            })  # fmt: skip
            if self.rank == 0:
                logger.info("%s: trained %d rows (%d of them carried in from the previous file)"
                            ", %d carried to the next; step %d", name, record.row,
                            record.carried_in, record.carried_out, self.progress.step)  # fmt: skip
                # kept: this file's carried rows and those a retained checkpoint inside it needs
                first = record.index if record.carry_from is None else record.carry_from
                carry.prune(self.run_dir, first)
                if not c.keep_cache:
                    inbox.drop_cache(Path(info["binary"]))
        self.tb.close()
        self.tb_files.close()
        self.prefetch.join()  # a cache half built by a thread the exit would kill
        self.early.discard()
        pending = self.ledger.done[-1].carried_out if self.ledger.done else 0
        return {"files": done, "step": self.progress.step, "consumed": len(self.ledger.done),
                "carried_rows": pending, "publish_due": self.due(),
                **self.guard.summary(), **self.outcomes.summary(),
                "run_dir": str(self.run_dir)}  # fmt: skip
