"""Typed training config: defaults < TOML preset < ``--flags`` and ``section.key=value``.

The dataclasses below are the whole interface: a docstring under each field (it becomes the
``--help`` text of the generated flag), ``Literal`` choices, nested dataclasses as TOML
sections. Loading, type checks and unknown-key suggestions are the shared
:mod:`recsys_stack.config`; this module adds the cross-field checks (:meth:`Config.validate`)
and the training command line. ``parse_args(argv)`` takes its own argv so tests can drive it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from recsys_stack import config as shared
from recsys_stack.typed import suggest
from training.errors import ConfigError
from training.features import NUM_SPARSE, SPARSE_NAMES, table_name
from training.metrics.baseline_config import BaselineConfig

T = TypeVar("T")
ShardingType = Literal[
    "data_parallel", "table_wise", "column_wise", "table_column_wise", "row_wise", "table_row_wise"
]
ComputeKernel = Literal["dense", "fused"]


@dataclass
class DataConfig:
    path: str = ""
    """Criteo TSV file or folder of day files; empty = the embedded synthetic set."""
    eval_fraction: float = 0.1
    """Last fraction of rows held out (time-ordered, like Criteo's last day), then split in two:
    validation first (data.valid_fraction of them), test last."""
    valid_fraction: float = 0.5
    """Share of the held-out rows, their first part, for validation: periodic evaluations,
    checkpoints/best, early stopping and sweeps. The rest is the test split, which only the
    final report and `make evaluate` score, so no decision made on it flatters them."""
    on_bad_row: Literal["skip", "fail"] = "skip"
    """Malformed rows: skip with a warning (up to max_bad_rows) or fail on the first one."""
    max_bad_rows: int = 1000
    """Fail when more malformed rows than this are skipped."""
    cache_dir: str = "data/cache"
    """Binary shards preprocessed from the TSV, keyed by the inputs' paths, sizes and mtimes,
    the table sizes (ids are stored hashed into model.num_embeddings) and the id hash."""
    preprocess_processes: int = 0
    """Processes that parse the TSV into the cache (0 = one per CPU core); they split the work
    by file and by line-aligned ranges of a large file, and write the same cache as one would."""
    synthetic_dir: str = "data/synthetic"
    """Where the synthetic TSV (and its true-probability sidecar) is generated."""
    synthetic_rows: int = 200_000
    """Rows of synthetic data (train + eval)."""
    synthetic_vocab: int = 1000
    """Distinct ids per synthetic categorical feature."""
    synthetic_seed: int = 0
    """Seed of the synthetic generator."""


@dataclass
class ModelConfig:
    arch: Literal["dlrm", "dlrm_dcn"] = "dlrm"
    """DLRM (dot interaction) or DLRM-DCN (DCN-v2 cross interaction)."""
    embedding_dim: int = 16
    """Width of every embedding table (D)."""
    num_embeddings: int | list[int] = 1000
    """Rows per table: one number for all 26, or a list of 26. Ids are hashed ``id mod rows``."""
    dense_arch: list[int] = field(default_factory=lambda: [64, 16])
    """Bottom MLP over the 13 dense features; its last size must equal embedding_dim."""
    over_arch: list[int] = field(default_factory=lambda: [64, 1])
    """Top MLP over the interaction; its last size must be 1 (one logit)."""
    dcn_num_layers: int = 3
    """DCN-v2 cross layers (arch = dlrm_dcn)."""
    dcn_low_rank_dim: int = 16
    """Low-rank width of each DCN-v2 cross layer (arch = dlrm_dcn)."""

    def rows(self) -> list[int]:
        """Rows of each of the 26 tables, in feature order."""
        if isinstance(self.num_embeddings, int):
            return [self.num_embeddings] * NUM_SPARSE
        return list(self.num_embeddings)


@dataclass
class TableSharding:
    sharding_types: list[ShardingType] = field(default_factory=list)
    """Sharding types the planner may choose for this table (empty = any)."""
    compute_kernels: list[ComputeKernel] = field(default_factory=list)
    """Compute kernels allowed (fused = fbgemm TBE with the optimizer in backward)."""
    min_partition: int = 0
    """Smallest column shard width for column-wise sharding (0 = planner default)."""


@dataclass
class ShardingConfig:
    sharding_types: list[ShardingType] = field(default_factory=list)
    """Sharding types allowed for every table (empty = all that the device supports)."""
    compute_kernels: list[ComputeKernel] = field(default_factory=list)
    """Compute kernels allowed for every table (empty = planner's choice)."""
    tables: dict[str, TableSharding] = field(default_factory=dict)
    """Per-table constraints keyed by table name (t_C1 .. t_C26); they replace the defaults."""
    storage_reservation: float = 0.15
    """Fraction of each rank's memory the planner keeps free for activations and buffers."""

    def __post_init__(self) -> None:
        if not 0.0 <= (r := self.storage_reservation) < 1.0:
            raise ConfigError(f"sharding.storage_reservation = {r}: must be in [0, 1)")

    memory_cap_gb: float = 0.0
    """Per-rank memory cap for the planner (DDR on CPU, HBM on GPU); 0 = measure the machine."""


@dataclass
class OptimConfig:
    embedding: Literal["rowwise_adagrad", "adagrad", "sgd", "adam"] = "rowwise_adagrad"
    """Embedding optimizer, fused into backward (fbgemm TBE)."""
    embedding_lr: float = 0.05
    """Learning rate of the fused embedding optimizer."""
    dense: Literal["adagrad", "adam", "sgd"] = "adagrad"
    """Optimizer of the MLPs (and of data-parallel tables)."""
    dense_lr: float = 0.05
    """Learning rate of the dense optimizer."""
    dense_weight_decay: float = 0.0
    """L2 weight decay of the dense optimizer (the MLPs; 0 = none): a regularizer."""


@dataclass
class TrainConfig:
    batch_size: int = 1024
    """Global batch size; each of W ranks takes batch_size / W rows of every step."""
    epochs: int = 1
    """Passes over the training split."""
    max_steps: int = 0
    """Stop after this many steps in total (0 = run the epochs)."""
    eval_every: int = 0
    """Evaluate every K steps (0 = only at the end)."""
    eval_rows: int = 0
    """Rows of the validation split used by periodic evaluations (0 = all); the final uses all."""
    checkpoint_every: int = 0
    """Save a checkpoint every K steps (0 = only at the end)."""
    keep_last: int = 3
    """Complete checkpoints kept; older ones are deleted after a newer one is complete."""
    pipeline: Literal["sparse_dist", "base"] = "sparse_dist"
    """TrainPipelineSparseDist overlaps the next batch's input all-to-all with this step."""
    compile_dense: bool = False
    """torch.compile the dense arch (bottom MLP) and over arch."""
    seed: int = 0
    """Seed of model init and of the per-epoch shuffle."""
    log_every: int = 20
    """Steps between progress-bar metric updates."""
    collective_timeout: int = 1800
    """Seconds a rank waits in one collective (a step's exchange, a checkpoint barrier, rank 0
    preparing data that ``--prepare-only`` did not) before it fails. A rank whose process dies
    is noticed at once (its connections close); this bounds the wait for one that hangs."""
    monitor: Literal["auc", "ne"] = "auc"
    """Validation metric that picks checkpoints/best and drives early stopping: auc (higher is
    better) or ne (lower), each evaluation's on the same rows (the first train.eval_rows)."""
    keep_best: bool = True
    """Save a checkpoint at each evaluation that improves train.monitor and name it in
    checkpoints/best; keep_last never deletes it. Export it with --checkpoint best."""
    early_stop_patience: int = 0
    """Stop after this many evaluations in a row without an improvement of train.monitor by
    at least early_stop_min_delta (0 = never stop early; needs train.eval_every)."""
    early_stop_min_delta: float = 0.0
    """Early stopping counts an evaluation as an improvement when it betters the best by more."""


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    sharding: ShardingConfig = field(default_factory=ShardingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    baseline: BaselineConfig = field(default_factory=BaselineConfig)
    name: str = "custom"
    """Preset name, recorded in checkpoints and metrics."""

    def validate(self) -> None:
        """Raise ConfigError naming the first inconsistent field."""
        rows = self.model.rows()
        if len(rows) != NUM_SPARSE:
            raise ConfigError(
                f"model.num_embeddings has {len(rows)} entries; it needs one per feature ({NUM_SPARSE})"
            )
        for i, r in enumerate(rows):
            if r < 1:
                raise ConfigError(
                    f"model.num_embeddings[{i}] (table {table_name(SPARSE_NAMES[i])}) = {r}: "
                    "a table needs at least 1 row"
                )
        m = self.model
        _positive("model.embedding_dim", m.embedding_dim)
        if not m.dense_arch or any(s < 1 for s in m.dense_arch):
            raise ConfigError(f"model.dense_arch = {m.dense_arch}: needs positive layer sizes")
        if m.dense_arch[-1] != m.embedding_dim:
            raise ConfigError(
                f"model.dense_arch ends with {m.dense_arch[-1]} but model.embedding_dim is "
                f"{m.embedding_dim}: the bottom MLP's output joins the embeddings, so they must match"
            )
        if not m.over_arch or m.over_arch[-1] != 1 or any(s < 1 for s in m.over_arch):
            raise ConfigError(f"model.over_arch = {m.over_arch}: positive sizes ending with 1")
        t = self.train
        for name in ("batch_size", "epochs", "keep_last", "collective_timeout"):
            _positive(f"train.{name}", getattr(t, name))
        for name in ("max_steps", "eval_every", "eval_rows", "checkpoint_every",
                     "early_stop_patience", "early_stop_min_delta"):  # fmt: skip
            if getattr(t, name) < 0:
                raise ConfigError(f"train.{name} = {getattr(t, name)}: must be >= 0")
        if t.early_stop_patience and not t.eval_every:
            raise ConfigError("train.early_stop_patience needs evaluations to compare: set "
                              "train.eval_every (e.g. train.eval_every=500)")  # fmt: skip
        self.baseline.check()
        if (procs := self.data.preprocess_processes) < 0:
            raise ConfigError(f"data.preprocess_processes = {procs}: must be >= 0 (0: each core)")
        for key in ("eval_fraction", "valid_fraction"):  # each split needs rows: prepare_data
            if not 0.0 < getattr(self.data, key) < 1.0:
                raise ConfigError(f"data.{key} = {getattr(self.data, key)}: must be in (0, 1)")
        tables = sorted(table_name(f) for f in SPARSE_NAMES)
        for tname in self.sharding.tables:
            if tname not in tables:
                raise ConfigError(f"sharding.tables.{tname}: no such table{suggest(tname, tables)}")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{name} = {value}: must be >= 1")


# ---------------------------------------------------------------------------------------------
# loading: the shared mechanism (recsys_stack.config), its errors as training's ConfigError


@contextlib.contextmanager
def config_errors() -> Iterator[None]:
    """Re-raise the shared loader's errors as :class:`training.errors.ConfigError`.

    Entry points catch :class:`RecsysError`; the shared ``ConfigError`` is not one (the
    torch-free serving side uses it too), so every training loader goes through here.
    """
    try:
        yield
    except shared.ConfigError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e)) from None


def load_stage_config(cls: type[T], ns: argparse.Namespace) -> T:
    """The ``cls`` that a command line parsed with :func:`add_config_args` asks for."""
    with config_errors():
        return shared.from_args(cls, ns)


def load_config(path: str | Path | None, overrides: typing.Sequence[str] = ()) -> Config:
    """Defaults < TOML file < overrides; validated. Errors name where the bad key came from."""
    with config_errors():
        cfg = shared.load(Config, path, overrides)
    cfg.validate()
    return cfg


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as recorded in ``config.json`` and checkpoint metadata."""
    return shared.to_dict(cfg)


def config_from_dict(raw: dict[str, Any]) -> Config:
    """A config recorded by :func:`config_to_dict` (not validated: it was when it ran)."""
    with config_errors():
        return shared.build(Config, raw)


# ---------------------------------------------------------------------------------------------
# command line


@dataclass
class RunArgs:
    """A parsed training command line: the validated config and how to run it."""

    config: Config
    run_dir: Path
    resume: str  # "auto" | "none" | a checkpoint path
    progress: bool
    prepare_only: bool
    world_size: int = 1  # the processes --prepare-only checks the batch against


def add_run_args(p: argparse.ArgumentParser, resume: str) -> None:
    """The options every command that trains a run takes: ``--run-dir``, ``--resume`` (its
    help: ``resume``) and ``--no-progress``."""
    p.add_argument("--run-dir", type=Path, help="run directory (default: runs/<preset name>)")
    p.add_argument("--resume", default="auto", help=resume)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")


def build_parser() -> argparse.ArgumentParser:
    """The training command line: run options, ``--config``, a flag per field, overrides."""
    p = shared.ArgumentParser(
        prog="torchrun --nproc_per_node=N -m training.train",
        description=(
            "Train a sharded DLRM with TorchRec. Embedding tables are placed by TorchRec's "
            "planner, trained with fused fbgemm kernels, evaluated with AUC/NE, and saved as "
            "sharded torch.distributed.checkpoint directories that resume on any world size."
        ),
        usage="%(prog)s [--config FILE.toml] [options] [section.key=value ...]",
        epilog=_epilog(),
    )
    add_run_args(
        p,
        resume="'auto' (default): continue from <run-dir>/checkpoints/latest if present; "
        "'none': start fresh; 'best', 'latest': what that file names; or a checkpoint directory",
    )
    p.add_argument("--data", help="Criteo TSV file or folder (same as data.path=..., wins over it)")
    p.add_argument(
        "--prepare-only",
        action="store_true",
        help="check the config and the checkpoint to resume, generate/preprocess the data, "
        "and exit (one process; `make train` runs this before torchrun)",
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=int(os.environ.get("WORLD_SIZE", "1")),
        help="processes the run will train on (all nodes): --prepare-only refuses a "
        "train.batch_size that they cannot split or the training rows cannot fill "
        "(default: $WORLD_SIZE, else 1; `make train` passes NPROC)",
    )
    shared.add_config_args(p, Config)
    return p


def table_keys_help() -> str:
    """Help for ``sharding.tables``: a table of tables, so an override only (no flag)."""
    docs = shared.field_docs(TableSharding)
    per_table = "; ".join(f"{name}: {doc.rstrip('.')}" for name, doc in docs.items())
    return (
        f"sharding.tables.<table>.<key> (table t_C1 .. t_C26): "
        f"{shared.field_docs(ShardingConfig)['tables']} Keys: {per_table}. "
        """Example: 'sharding.tables.t_C1.sharding_types=["column_wise"]'."""
    )


def _epilog() -> str:
    return (
        "Every config field is also a section.key=value override in TOML syntax, applied "
        "after --config and the flags, e.g. train.max_steps=200 "
        f"model.num_embeddings=[100,200,...]. {table_keys_help()} "
        "Presets: training/configs/{tiny,demo,criteo-kaggle}.toml."
    )


def parse_args(argv: typing.Sequence[str] | None = None) -> RunArgs:
    """``argv`` -> the validated config and the run options. Raises ConfigError."""
    # intermixed: overrides may come before, between and after the options
    ns = build_parser().parse_intermixed_args(argv)
    overrides = shared.overrides_from(ns)
    if ns.data:
        overrides.append(f"data.path={_toml_str(ns.data)}")
    cfg = load_config(ns.config, overrides)
    named = any(o.partition("=")[0].strip() == "name" for o in overrides)
    if ns.config is not None and not named and cfg.name == "custom":
        cfg = dataclasses.replace(cfg, name=ns.config.stem)  # a preset file names the run
    return RunArgs(
        config=cfg,
        run_dir=ns.run_dir or Path("runs") / cfg.name,
        resume=ns.resume,
        progress=not ns.no_progress,
        prepare_only=ns.prepare_only,
        world_size=max(1, ns.world_size),
    )


def _toml_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
