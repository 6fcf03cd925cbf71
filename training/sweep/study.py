"""The sweep's loop: open (or continue) the study, run trials in parallel within the budget.

The budget counts the study's trials, whoever ran them: complete, pruned, running, and failed
by their own run (an error the sweep should not retry forever); a trial failed because its
sweep was interrupted or killed (marked so when found stale) is not counted, so that the same
command redoes it. Several processes may share one storage (a journal file on shared storage,
or an RDB URL): each checks the count before it asks for a trial, so the study ends with
``trials`` trials, give or take the ones that started at the same moment in other processes.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from recsys_stack.cpus import available_cpus
from training.config import load_config
from training.errors import ConfigError, RecsysError
from training.sweep import space as search_space
from training.sweep import trial as runner
from training.sweep.options import SweepArgs

logger = logging.getLogger("training.sweep")


class PrepareFailed(RecsysError):
    """``--prepare-only`` of the preset failed (it printed why); ``code`` is its exit code."""

    def __init__(self, code: int) -> None:
        super().__init__(f"the preset's --prepare-only exited {code}")
        self.code = code


def parallel_trials(args: SweepArgs) -> int:
    """Trials at once: ``parallel``, or the CPUs this process may use / threads per trial."""
    cfg = args.config
    return cfg.parallel or max(1, available_cpus() // cfg.threads_per_trial)


def open_study(args: SweepArgs) -> Any:
    """The study in ``--storage`` (default: ``<out>/study.journal``), created or loaded, with
    the TPE sampler (constant liar: parallel trials do not all draw the same point) and the
    pruner; refused when it searched another preset or other training overrides."""
    import optuna
    from optuna.storages.journal import JournalFileBackend, JournalStorage

    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cfg = args.config
    storage: Any = cfg.storage
    if not storage:
        args.out.mkdir(parents=True, exist_ok=True)
        storage = JournalStorage(JournalFileBackend(str(args.out / "study.journal")))
    study = optuna.create_study(
        storage=storage, study_name=args.study_name, direction="maximize", load_if_exists=True,
        pruner=_pruner(args),
    )  # fmt: skip
    study.sampler = optuna.samplers.TPESampler(
        seed=cfg.seed + len(study.trials), n_startup_trials=cfg.startup_trials, constant_liar=True
    )
    what = {"preset": str(cfg.preset_path()), "train_overrides": args.train_overrides}
    for key, value in what.items():
        if key not in study.user_attrs:
            study.set_user_attr(key, value)
        elif study.user_attrs[key] != value:
            raise ConfigError(
                f"study {args.study_name} ({cfg.storage or args.out / 'study.journal'}) searched "
                f"{key} = {study.user_attrs[key]!r}, not {value!r}: give the same, or another "
                "--study-name / --out to start a new sweep"
            )
    return study


def _pruner(args: SweepArgs) -> Any:
    import optuna

    cfg = args.config
    if cfg.pruner == "median":  # steps are evaluations (eval_grid): warm-up counted in them
        return optuna.pruners.MedianPruner(
            n_startup_trials=cfg.prune_startup_trials, n_warmup_steps=cfg.prune_warmup_evals + 1
        )
    if cfg.pruner == "hyperband":  # resources in evaluations: the first rung at the first
        return optuna.pruners.HyperbandPruner(min_resource=1)
    return optuna.pruners.NopPruner()


def eval_grid(args: SweepArgs) -> int:
    """Training rows between two of the preset's evaluations (0: it evaluates only at the
    end): a trial's evaluations are reported to the pruner as steps of this grid."""
    t = args.base.train
    return t.eval_every * t.batch_size


def counted(study: Any) -> int:
    """Trials that count against the budget (see the module's docstring)."""
    from optuna.trial import TrialState

    kept = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    return sum(
        t.state in kept or (t.state == TrialState.FAIL and "failed" in t.user_attrs)
        for t in study.get_trials(deepcopy=False)
    )


def needs_default(study: Any) -> bool:
    """Whether the study lacks the preset's own trial: none yet, or only interrupted ones (a
    sweep stopped during its first trials redoes it)."""
    from optuna.trial import TrialState

    kept = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING, TrialState.WAITING)
    return not any(
        t.user_attrs.get("default") and (t.state in kept or "failed" in t.user_attrs)
        for t in study.get_trials(deepcopy=False)
    )


def fail_stale(study: Any, stale_after_s: float) -> list[int]:
    """Mark failed (not counted) the running trials whose sweep gave no sign of life for
    ``stale_after_s`` seconds: it was killed with them. Their numbers."""
    from optuna.trial import TrialState

    now, stale = time.time(), []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        alive = t.user_attrs.get("alive") or (
            t.datetime_start.timestamp() if t.datetime_start else 0
        )
        if now - alive > stale_after_s:
            study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
            stale.append(t.number)
    if stale:
        logger.warning("trials %s were left running by a sweep that died: marked failed, "
                       "not counted (they are redone)", stale)  # fmt: skip
    return stale


def prepare(args: SweepArgs) -> None:
    """The preset's ``--prepare-only`` with the training overrides, once before the trials:
    a bad config or data fails here in one line, and the data is generated or preprocessed
    once (trials with other rows per table prepare their own cache at their start)."""
    cmd = [sys.executable, "-m", "training.train", "--prepare-only", "--world-size", "1",
           "--config", str(args.config.preset_path()), "--run-dir", str(args.out / "prepare"),
           "--resume", "none", *args.train_overrides]  # fmt: skip
    code = subprocess.run(cmd, stdin=subprocess.DEVNULL).returncode
    if code:
        raise PrepareFailed(code)


class Sweep:
    """Runs trials in ``parallel`` threads (each waits on its training process) until the
    budget, the deadline, ``max_failures`` failures in a row or an interrupt."""

    def __init__(self, args: SweepArgs, study: Any) -> None:
        self.args, self.study, self.cfg = args, study, args.config
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.deadline = time.monotonic() + self.cfg.timeout if self.cfg.timeout else 0.0
        self.failures = 0
        self.ran = 0

    def run(self, parallel: int) -> None:
        """Start the workers and wait; on KeyboardInterrupt, end the running trials first.

        Waits on events the workers set as they finish, not on ``Thread.join``: a join that a
        KeyboardInterrupt interrupts can leave the thread looking finished (CPython before
        3.13), and the report was then written before the last trial was told."""
        done = [threading.Event() for _ in range(parallel)]
        for event in done:
            threading.Thread(target=self._worker, args=(event,), daemon=True).start()
        try:
            for event in done:
                while not event.wait(0.2):
                    pass
        except KeyboardInterrupt:
            self.stop.set()
            for event in done:
                event.wait()
            raise

    def _may_start(self) -> bool:
        if self.stop.is_set() or (self.deadline and time.monotonic() >= self.deadline):
            return False
        if self.failures >= self.cfg.max_failures:
            return False
        return counted(self.study) < self.cfg.trials

    def _worker(self, done: threading.Event) -> None:
        try:
            while True:
                with self.lock:
                    if not self._may_start():
                        return
                    trial = self.study.ask()
                    self.ran += 1
                self._trial(trial)
        finally:
            done.set()

    def _trial(self, trial: Any) -> None:
        from optuna.trial import TrialState

        a = self.args
        values = search_space.suggest(trial, a.base, self.cfg.space)
        ovr = [*a.train_overrides, *search_space.overrides(values)]
        run_dir = a.out / f"trial_{trial.number:04d}"
        shown = " ".join(search_space.overrides(values))
        for key, value in {"overrides": search_space.overrides(values), "run_dir": str(run_dir),
                           "host": socket.gethostname(), "alive": time.time()}.items():  # fmt: skip
            trial.set_user_attr(key, value)
        start = time.monotonic()
        try:
            load_config(a.config.preset_path(), ovr)  # a bad combination fails without a run
            if run_dir.exists():  # a number is the study's once: this is an older study's
                shutil.rmtree(run_dir)
            logger.info("trial %d: %s", trial.number, shown)
            watch = runner.Watch(
                report=trial.report, should_prune=trial.should_prune, stop=self.stop,
                heartbeat=lambda: trial.set_user_attr("alive", time.time()),
                deadline=self.deadline, poll_s=self.cfg.poll_s, grid=eval_grid(a),
            )  # fmt: skip
            cmd = runner.command(a.config.preset_path(), run_dir, ovr)
            records = runner.run(cmd, run_dir, self.cfg.threads_per_trial, watch)
            value = runner.trial_value(records)
            if value is None:
                raise runner.Failed(f"the run wrote no validation evaluation ({run_dir})")
        except runner.Pruned as e:
            trial.set_user_attr("pruned", e.reason)
            trial.set_user_attr("seconds", round(time.monotonic() - start, 1))
            self.study.tell(trial, state=TrialState.PRUNED)
            logger.info("trial %d %s", trial.number, e.reason)
        except runner.Interrupted:
            self.study.tell(trial, state=TrialState.FAIL)  # not counted: redone on resume
        except (runner.Failed, ConfigError) as e:
            trial.set_user_attr("failed", str(e))
            self.study.tell(trial, state=TrialState.FAIL)
            with self.lock:
                self.failures += 1
            logger.warning("trial %d failed: %s", trial.number, e)
        else:
            trial.set_user_attr("value", value)
            trial.set_user_attr("seconds", round(time.monotonic() - start, 1))
            self.study.tell(trial, value["auc"])
            with self.lock:
                self.failures = 0
            ci = value.get("auc_ci")
            logger.info("trial %d: validation AUC %.4f%s on %s rows, %.0f s", trial.number,
                        value["auc"], f" [{ci[0]:.4f}, {ci[1]:.4f}]" if ci else "",
                        f"{value.get('eval_rows', 0):,}", time.monotonic() - start)  # fmt: skip


def run_sweep(args: SweepArgs) -> tuple[Any, Sweep | None]:
    """Open the study, enqueue the preset's own config in a new one, prepare the data and
    run what the budget leaves. The study, and the :class:`Sweep` (None when nothing ran)."""
    study = open_study(args)
    fail_stale(study, args.config.stale_after_s)
    if args.config.include_default and needs_default(study):
        params = search_space.default_params(args.base, args.config.space)
        study.enqueue_trial(params, user_attrs={"default": True})
    left = args.config.trials - counted(study)
    if left <= 0:
        logger.info("study %s has %d trials (trials = %d): nothing to run", args.study_name,
                    counted(study), args.config.trials)  # fmt: skip
        return study, None
    parallel = min(parallel_trials(args), left)
    logger.info("sweep %s: %d trials to run (%d in the study), %d at a time, in %s",
                args.study_name, left, counted(study), parallel, args.out)  # fmt: skip
    prepare(args)
    sweep = Sweep(args, study)
    sweep.run(parallel)
    if sweep.failures >= args.config.max_failures:
        logger.error("stopped after %d failed trials in a row: see their train.log",
                     sweep.failures)  # fmt: skip
    return study, sweep


def journal_path(args: SweepArgs) -> Path | None:
    """The journal file when the study is in one (the default storage)."""
    return None if args.config.storage else args.out / "study.journal"
