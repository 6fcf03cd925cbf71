"""The continuous loop's command line: the training config plus a ``[continuous]`` section.

The base is the config recorded in the run's checkpoint (the model it warm-starts must keep its
shape), then the one mechanism of every stage (:mod:`recsys_stack.config`)::

    defaults < RUN's checkpoint config < --config FILE.toml < environment < flags, key=value

so ``optim.embedding_lr=0.02`` or ``train.batch_size=512`` change how the loop trains, and a
change of ``model.*`` is refused like any resume of another shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from recsys_stack import config as shared
from recsys_stack.config import env_field
from training.config import Config, add_run_args, config_errors, config_to_dict
from training.errors import ConfigError, RecsysError

SERVE_DIR_ENV = "RECSYS_SERVE_DIR"  # the running stack's state folder (make serve's)
AFTER_REFUSAL = ("served", "candidate")


@dataclass
class ContinuousSection:
    data_dir: str = ""
    """Folder the click-log files arrive in (Criteo TSV), consumed in name order. A file must
    appear complete, by rename: names starting with '.' or ending in '.tmp' are never read,
    nor sidecars (.prob.npy) and folders (rejected/)."""
    follow: bool = False
    """Keep polling data_dir for new files (off: process the files there, then exit)."""
    poll_s: float = 10.0
    """Seconds between looks at data_dir when following."""
    max_files: int = 0
    """Stop after this many files in this invocation (0 = no limit)."""
    learn: bool = True
    """Train one pass on each file after scoring it (off: score only, as a model frozen at
    its checkpoint would be scored)."""
    progressive_rows: int = 0
    """Rows of each file scored by the progressive validation before training on it (its
    first rows; 0 = all)."""
    checkpoint_every: int = 0
    """Steps between checkpoints inside a file (0 = only at the end of each file); each
    records the file and the row position, so a killed run resumes there."""
    export_every: int = 1
    """Publish a new version every this many files trained (0 = never), when the next file
    arrives: its rows, which no model trained on yet, are the version's unseen rows (schema
    and parity) and what its rollout is judged on; the last model of a run that stops waits
    for the next file."""
    export_args: list[str] = field(default_factory=list)
    """Extra arguments of `python -m training.export` (e.g. ["--parity-rows", "5000"])."""
    model_store: Path = Path("model_store")
    """Where exported versions go when no stack is serving (else the stack's store)."""
    rollout: bool = True
    """After an export, when a stack is serving (serve_dir/plan.json), roll the version out,
    evaluated against the served default on the file that just arrived, before any model
    trains on it (refused: recorded, go on)."""
    serve_dir: Path = env_field(SERVE_DIR_ENV, Path("runs/serve"))
    """The running stack's state folder (make serve's)."""
    rollout_eval_rows: int = 20_000
    """Rows of the arriving file (its first) the rollout compares the two versions on, before
    either trained on them (0 = all)."""
    rollout_args: list[str] = field(default_factory=list)
    """Extra arguments of `python -m serving.tools.rollout` (e.g. ["--dwell-s", "3"])."""
    deltas: bool = False
    """Publish as embedding deltas over the served default (issue 36: the rows whose bytes
    changed in the tables the workers serve, int8, int4 or mixed, + the dense weights, applied
    by every worker in place, no export, no registration; training/continuous/deltas.py)
    whenever RUN/export is that default's export; otherwise, every ``compact_every`` deltas,
    for a variant with no delta path, and when a delta is refused by the workers or not
    acknowledged, a full export + rollout."""
    compact_every: int = 4
    """Deltas in a chain before the next publish is a full export + rollout (compaction)."""
    delta_dwell_s: float = 0.0
    """After every worker serves a delta: seconds the gateway's error gate watches the served
    version (non-OK calls above 1%, or fewer than 20 calls to judge: rolled back); 0 = off."""
    delta_timeout_s: float = 60.0
    """Longest wait for every worker to acknowledge a delta (then it is put back and the
    publish is a full export + rollout)."""
    keep_cache: bool = False
    """Keep each file's preprocessed cache (data.cache_dir) after it is consumed."""
    quarantine_window: int = 5
    """Files (the last trained, quarantined ones apart) an arriving file's label rate and
    progressive AUC are compared with (0 = no quarantine; training/continuous/poison.py)."""
    quarantine_label_odds: float = 3.0
    """Quarantine a file whose label odds (rate / (1 - rate)) differ from the recent files'
    median odds by more than this factor, either way (0 = off)."""
    quarantine_auc_drop: float = 0.15
    """Quarantine a file the served model scores this much AUC below its median on the recent
    files (below 0.5: "labels look inverted"; 0 = off). Scored first by the current model; a
    file it flags is scored by the served version's weights too, and quarantined only when
    they flag it as well (a bad current model is the gate's to refuse)."""
    after_refusal: str = "served"
    """After the gate refuses a candidate: "served", the next pass starts from the served
    version's checkpoint (RUN/served/, pinned at each promotion); "candidate", training goes
    on from the refused weights."""
    require_publish: bool = True
    """A run whose every publish failed (nothing exported or rolled out, the gate apart)
    exits 3 with the fix (torchrun, make continuous: 1); false: it exits 0, the warnings stand."""


@dataclass
class ContinuousConfig(Config):
    continuous: ContinuousSection = field(default_factory=ContinuousSection)

    def validate(self) -> None:
        super().validate()
        c = self.continuous
        for name in (
            "max_files",
            "progressive_rows",
            "checkpoint_every",
            "export_every",
            "compact_every",
            "quarantine_window",
            "quarantine_label_odds",
            "quarantine_auc_drop",
        ):
            if getattr(c, name) < 0:
                raise ConfigError(f"continuous.{name} = {getattr(c, name)}: must be >= 0")
        if c.delta_timeout_s <= 0:
            raise ConfigError(f"continuous.delta_timeout_s = {c.delta_timeout_s}: must be > 0")
        if c.after_refusal not in AFTER_REFUSAL:
            raise ConfigError(
                f"continuous.after_refusal = {c.after_refusal!r}: one of {', '.join(AFTER_REFUSAL)}"
            )
        if c.poll_s <= 0:
            raise ConfigError(f"continuous.poll_s = {c.poll_s}: must be > 0")
        if not c.data_dir:
            raise ConfigError("which folder? --data-dir DIR (continuous.data_dir)")


@dataclass
class ContinuousArgs:
    config: ContinuousConfig
    run_dir: Path
    resume: str  # "auto" | "none" | a checkpoint path
    progress: bool


def build_parser() -> argparse.ArgumentParser:
    p = shared.ArgumentParser(
        prog="torchrun --nproc_per_node=N -m training.continuous",
        description=(
            "Keep a model fresh: warm-start from the run's latest checkpoint, then for each "
            "new file of --data-dir (name order): score it with the current model (progressive "
            "validation -> RUN/progressive.jsonl); every continuous.export_every files, export "
            "that model with this file as its unseen rows and, when a stack is serving, roll "
            "it out judged on them against the served default; then train one pass on it "
            "(the rows of the last partial batch carried to the next file), checkpoint with "
            "the file and row position."
        ),
        usage="%(prog)s --run-dir RUN --data-dir DIR [--follow] [options] [section.key=value ...]",
    )
    add_run_args(
        p,
        resume="'auto' (default): the run's checkpoints/latest, or a fresh model from the config "
        "when it has none; 'none': a fresh model; or a checkpoint directory to warm-start from",
    )
    p.add_argument("--data-dir", help="the folder files arrive in (= continuous.data_dir=...)")
    p.add_argument("--follow", action="store_true", help="keep polling (= continuous.follow)")
    shared.add_config_args(p, ContinuousConfig)
    return p


def recorded_config(run_dir: Path, resume: str) -> dict[str, Any]:
    """The training config of the checkpoint the loop would warm-start from (empty: none)."""
    from training.checkpoint import store as checkpoint  # torch: not for a --help

    try:
        path = checkpoint.resolve(resume, run_dir / "checkpoints")
        if path is None:
            return {}
        raw: dict[str, Any] = checkpoint.read_meta(path).get("config", {})
    except RecsysError:  # reported with its reason when the loop opens it
        return {}
    return raw


def load(base: dict[str, Any], path: Path | None, overrides: Sequence[str]) -> ContinuousConfig:
    """``base`` < ``path`` < environment < ``overrides``, type-checked and validated; an error
    names where the bad key came from (the file, the variables or the command line)."""
    with config_errors():
        cfg = shared.load(ContinuousConfig, path, overrides, base=base)
    cfg.validate()
    return cfg


def parse_args(argv: Sequence[str] | None = None) -> ContinuousArgs:
    """``argv`` -> the validated config and the run options. Raises ConfigError."""
    ns = build_parser().parse_intermixed_args(argv)
    overrides = shared.overrides_from(ns)
    if ns.data_dir:
        overrides.append(f"continuous.data_dir={json.dumps(ns.data_dir)}")
    if ns.follow:
        overrides.append("continuous.follow=true")
    cfg = load({}, ns.config, overrides)  # errors in the arguments first, before any file
    run_dir = ns.run_dir or Path("runs") / (ns.config.stem if ns.config else cfg.name)
    base = recorded_config(run_dir, ns.resume)
    if base:
        base.pop("continuous", None)
        cfg = load(base, ns.config, overrides)
    elif ns.config is not None and cfg.name == "custom":
        cfg = dataclasses.replace(cfg, name=ns.config.stem)
    return ContinuousArgs(cfg, run_dir, ns.resume, not ns.no_progress)


def training_config(cfg: ContinuousConfig, path: Path | None) -> dict[str, Any]:
    """The config recorded in checkpoints: the training sections (``make export`` reads them),
    with ``data.path`` = the file trained last."""
    raw = config_to_dict(cfg)
    raw.pop("continuous", None)
    if path is not None:
        raw["data"]["path"] = str(path)
    return raw


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
