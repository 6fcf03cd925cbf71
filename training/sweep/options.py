"""The sweep's config and command line (torch- and Optuna-free: ``--help`` answers at once).

``python -m training.sweep --preset tiny --trials 8 train.max_steps=200``: the sweep's own keys
are flags (``--trials``) or top-level / ``space.`` overrides (``trials=8``); an override whose
section is a training one (``data.``, ``model.``, ``optim.``, ``train.``, ...) is passed to
every trial, before the trial's own values.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from recsys_stack import config as shared
from training.config import Config, _toml_str, config_errors, load_config
from training.errors import ConfigError

Param = Literal[
    "embedding_lr", "dense_lr", "embedding_dim", "num_embeddings", "batch_size",
    "dense_weight_decay", "epochs", "dense_arch", "over_arch",
]  # fmt: skip
ALL_PARAMS: list[Param] = list(typing.get_args(Param))
TRAINING_SECTIONS = {f.name for f in dataclasses.fields(Config)}


@dataclass
class SpaceConfig:
    params: list[Param] = field(default_factory=lambda: list(ALL_PARAMS))
    """What is searched (the rest stays as the preset has it): embedding_lr, dense_lr (the
    sparse and dense optimizers' learning rates), embedding_dim, num_embeddings (rows per
    table), batch_size, dense_weight_decay, epochs, dense_arch, over_arch (the MLPs' widths)."""
    lr_factor: float = 4.0
    """Learning rates are searched log-uniformly in [preset / lr_factor, preset * lr_factor]."""
    size_factors: list[float] = field(default_factory=lambda: [0.5, 1.0, 2.0])
    """Sizes are the preset's times one of these: embedding dim, rows per table, batch size,
    the hidden widths of dense_arch and over_arch."""
    max_epochs: int = 3
    """Epochs are searched in 1..max_epochs (CTR models tend to overfit after the first)."""
    weight_decays: list[float] = field(default_factory=lambda: [0.0, 1e-6, 1e-5, 1e-4])
    """Choices of optim.dense_weight_decay."""


@dataclass
class SweepConfig:
    preset: str = "demo"
    """The preset searched around: a name in training/configs/ (tiny, demo, criteo-kaggle) or
    a TOML file the trainer takes."""
    out: Path | None = None
    """The sweep folder: the study's journal, trial_NNNN/ runs, report.md, trials.png,
    best.toml (default: runs/sweep-<preset name>)."""
    trials: int = 20
    """Trials the study should have in all: those of earlier invocations and of other
    processes sharing the storage count (the same command continues a sweep)."""
    timeout: float = 0.0
    """Seconds this invocation may run (0 = no limit): no trial starts after, and a trial
    still running then is stopped and recorded as pruned (at its last evaluation)."""
    parallel: int = 0
    """Trials run at once (0 = the CPUs this process may use / threads_per_trial)."""
    threads_per_trial: int = 1
    """Torch threads of each trial (OMP_NUM_THREADS)."""
    storage: str = ""
    """An Optuna storage URL (sqlite:///sweep.db, postgresql://...) shared by every process of
    the sweep; empty = the journal file <out>/study.journal (put <out> on shared storage to
    spread a sweep over nodes)."""
    study_name: str = ""
    """The study's name in the storage (default: sweep-<preset name>)."""
    seed: int = 0
    """Seed of the TPE sampler (offset by the trials already in the study, so that a resumed
    or second process does not draw the same first configs again)."""
    startup_trials: int = 6
    """Random trials before TPE models the results (the preset's own config is the first)."""
    pruner: Literal["median", "hyperband", "none"] = "median"
    """Stops a trial whose validation AUC at an evaluation is below the median of the trials
    before it at the same rows seen (median), or Hyperband's successive halving."""
    prune_startup_trials: int = 3
    """Trials that run to their end before the median pruner stops any."""
    prune_warmup_evals: int = 1
    """Evaluations of a trial before the median pruner may stop it (the first ones are noisy,
    and a slow starter may still win)."""
    include_default: bool = True
    """The first trial of a new study trains the preset as it is, so the report says what the
    search gained over it."""
    poll_s: float = 1.0
    """Seconds between reads of a running trial's metrics.jsonl."""
    stale_after_s: float = 600.0
    """A trial still marked running whose sweep process gave no sign of life for this long
    (killed with it) is marked failed and not counted, so that a rerun redoes it."""
    max_failures: int = 3
    """Stop after this many failed trials in a row (each names its log)."""
    space: SpaceConfig = field(default_factory=SpaceConfig)
    """What is searched, and how far from the preset."""

    def preset_path(self) -> Path:
        """The preset's TOML file: training/configs/<preset>.toml, or the path given."""
        named = Path("training/configs") / f"{self.preset}.toml"
        path = "/" in self.preset or self.preset.endswith(".toml")
        return Path(self.preset) if path else named

    def validate(self) -> None:
        """ConfigError naming the first bad key."""
        checks = [
            ("trials", self.trials >= 0, ">= 0 (0: only write the report)"),
            ("timeout", self.timeout >= 0, ">= 0 (0: no limit)"),
            ("parallel", self.parallel >= 0, ">= 0 (0: as the CPUs allow)"),
            ("threads_per_trial", self.threads_per_trial >= 1, ">= 1"),
            ("poll_s", self.poll_s > 0, "> 0"),
            ("max_failures", self.max_failures >= 1, ">= 1"),
            ("prune_warmup_evals", self.prune_warmup_evals >= 0, ">= 0"),
            ("space.lr_factor", self.space.lr_factor >= 1, ">= 1"),
            ("space.max_epochs", self.space.max_epochs >= 1, ">= 1"),
            ("space.size_factors", min(self.space.size_factors, default=0) > 0, "positive"),
            ("space.weight_decays", min(self.space.weight_decays, default=-1) >= 0, ">= 0"),
        ]
        for key, ok, want in checks:
            if not ok:
                owner, leaf = (self.space, key[6:]) if key.startswith("space.") else (self, key)
                value = getattr(owner, leaf)
                raise ConfigError(f"{key} = {value}: must be {want}")
        if not self.preset_path().is_file():
            raise ConfigError(
                f"preset = {self.preset}: no {self.preset_path()} (presets: tiny, demo, "
                "criteo-kaggle, or the path of a training TOML)"
            )


@dataclass
class SweepArgs:
    """A parsed sweep command line: its config, and the training overrides every trial gets."""

    config: SweepConfig
    train_overrides: list[str]
    base: Config  # the preset with train_overrides: what the search starts from

    @property
    def out(self) -> Path:
        return self.config.out or Path("runs") / f"sweep-{self.base.name}"

    @property
    def study_name(self) -> str:
        return self.config.study_name or f"sweep-{self.base.name}"


def build_parser() -> shared.ArgumentParser:
    p = shared.ArgumentParser(
        prog="python -m training.sweep",
        description=(
            "Search a preset's hyperparameters (learning rates, embedding dim, rows per table, "
            "batch size, weight decay, epochs, MLP widths) with Optuna's TPE sampler and a "
            "pruner, on the validation AUC of real training runs, within a trial count and/or "
            "a time budget, trials in parallel as the CPUs allow. The study is kept in the "
            "sweep folder (or --storage): the same command continues it, and several processes "
            "on the same storage share it (nodes, Slurm array tasks). Writes report.md, "
            "trials.png, summary.json and best.toml (python -m training.train --config "
            "<out>/best.toml trains it)."
        ),
        usage="%(prog)s [--preset NAME] [--trials N] [--timeout S] [options] "
        "[key=value ...] [train.key=value ...]",
        epilog="Overrides whose section is a training one (data., model., optim., train., "
        "baseline., sharding.) go to every trial, e.g. train.max_steps=500 or "
        'data.path="/data/criteo/day_0": the search starts from the preset with them.',
    )
    p.add_argument("--data", help="Criteo TSV file or folder for every trial (data.path=...)")
    shared.add_config_args(p, SweepConfig)
    return p


def parse_args(argv: typing.Sequence[str] | None = None) -> SweepArgs:
    """``argv`` -> the validated sweep config and the preset it starts from. ConfigError."""
    ns = build_parser().parse_intermixed_args(argv)
    sweep: list[str] = []
    train: list[str] = []
    for item in shared.overrides_from(ns):
        key = item.partition("=")[0].strip()
        (train if key.partition(".")[0] in TRAINING_SECTIONS else sweep).append(item)
    if ns.data:
        train.append(f"data.path={_toml_str(ns.data)}")
    with config_errors():
        cfg = shared.load(SweepConfig, ns.config, sweep)
    cfg.validate()
    base = load_config(cfg.preset_path(), train)
    if not any(o.partition("=")[0].strip() == "name" for o in train) and base.name == "custom":
        base = dataclasses.replace(base, name=cfg.preset_path().stem)
    return SweepArgs(config=cfg, train_overrides=train, base=base)
