"""Sharded, resumable checkpoints with torch.distributed.checkpoint (DCP).

Layout under ``<run>/checkpoints/``::

    step_00000100/          complete: DCP shards + .metadata, meta.json, plan.json
    step_00000200.partial/  being written (or left by a killed save; ignored, then removed)
    step_00000100.old/      the previous step_00000100 while a re-save of that step swaps in
    latest                  text file naming the newest complete step directory
    best                    text file naming the best one by held-out metric (training.step_loop)

Every rank writes its own shards into ``step_N.partial``; only after DCP has written the
metadata and every rank has passed a barrier does rank 0 rename the directory and replace
``latest`` atomically. A save killed at any point leaves ``latest`` on the previous one.

Re-saving a step that exists (a resumed run redoing steps) is built aside the same way, then
swapped in with two renames: ``step_N`` -> ``step_N.old``, ``step_N.partial`` -> ``step_N``,
and only then is ``step_N.old`` deleted. ``latest`` keeps naming ``step_N`` throughout;
:func:`read_latest` takes ``step_N.old`` while ``step_N`` is missing or incomplete, so at every
instant ``latest`` resolves to a complete checkpoint (the old one until the second rename, the
new one after). The next save puts back or deletes whatever an interrupted swap left.
``best`` is written like ``latest`` (by the save that makes a best checkpoint, after the rename)
and read the same way; pruning to ``keep_last`` never deletes what either names.

Loading goes through DCP, which reshards onto whatever world size and plan the resuming job
has. One state TorchRec does not reshard by itself: the row-wise Adagrad accumulator of a
column-sharded table is stored per column shard (``rows * shards`` values). It is converted
here through its canonical per-row form (the width-weighted mean over column shards, which is
exactly the accumulator a full-row table would have), in :mod:`training.checkpoint.rowwise`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from recsys_model.atomic import fsync_dir, write_atomic
from training.checkpoint import rowwise
from training.errors import CheckpointError

logger = logging.getLogger(__name__)

LATEST = "latest"
BEST = "best"
POINTERS = (LATEST, BEST)  # the names --resume and export's --checkpoint take as well as a path
META = "meta.json"
PLAN = "plan.json"
PARTIAL = ".partial"
OLD = ".old"  # the replaced copy of a step during a re-save's swap
_STEP_DIR = re.compile(r"^step_\d+$")
# Fault injection for the crash-during-save test: rank 0 SIGKILLs itself after every rank has
# written its shards and before the directory is renamed (the most delicate moment).
KILL_IN_SAVE_ENV = "RECSYS_TEST_KILL_IN_SAVE_AT_STEP"
# Model fields that fix tensor shapes; a checkpoint resumes only into the same ones.
SHAPE_FIELDS = (
    "arch",
    "embedding_dim",
    "num_embeddings",
    "dense_arch",
    "over_arch",
    "dcn_num_layers",
    "dcn_low_rank_dim",
)


@dataclass
class Progress:
    """Where training stands; stored in meta.json."""

    step: int = 0
    epoch: int = 0
    rows_in_epoch: int = 0
    samples_seen: int = 0

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Take the values recorded in a checkpoint's meta.json (in place: the loop holds self)."""
        restored = Progress(**state)  # unknown or missing keys fail here, not later
        for f in fields(self):
            setattr(self, f.name, getattr(restored, f.name))


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def is_complete(path: Path) -> bool:
    return (path / ".metadata").is_file() and (path / META).is_file()


def complete_checkpoints(root: Path) -> list[Path]:
    """Complete step directories, oldest first."""
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if _STEP_DIR.match(p.name)]  # not .partial, not .old
    return sorted((p for p in dirs if is_complete(p)), key=lambda p: p.name)


def save(
    root: Path,
    progress: Progress,
    state: dict[str, Any],
    meta: dict[str, Any],
    plan: list[dict[str, Any]],
    keep_last: int,
    best: bool = False,
    files: Callable[[Path], None] | None = None,
) -> Path:
    """Collective: every rank writes its shards of ``state`` (rank 0 also ``files(folder)``,
    its own files); returns the complete directory, named by ``latest`` and, when ``best``,
    by ``best`` too."""
    final = root / step_dir_name(progress.step)
    tmp = root / (final.name + PARTIAL)
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        _recover(root)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    t0 = time.perf_counter()
    dcp.save(state, checkpoint_id=str(tmp))
    if _rank() == 0:
        record = {**meta, "progress": progress.__dict__, "saved_at": time.time()}
        write_atomic(tmp / META, json.dumps(record, indent=2, sort_keys=True))
        write_atomic(tmp / PLAN, json.dumps(plan, indent=2))
        if files is not None:
            files(tmp)
    _barrier()  # every rank's shards are on disk
    if _rank() == 0:
        if os.environ.get(KILL_IN_SAVE_ENV) == str(progress.step):
            logger.warning(
                "%s: killing rank 0 during the save of step %d", KILL_IN_SAVE_ENV, progress.step
            )
            os.kill(os.getpid(), signal.SIGKILL)
        old = _aside(final)
        if final.exists():  # re-saving a step after a resume: swap the new one in (see top)
            os.replace(final, old)  # latest, if it names final, resolves to old meanwhile
            fsync_dir(root)
        os.replace(tmp, final)
        fsync_dir(root)
        write_atomic(root / LATEST, final.name + "\n")
        if best:
            write_atomic(root / BEST, final.name + "\n")
        shutil.rmtree(old, ignore_errors=True)
        _prune(root, keep_last)
        logger.info("checkpoint %s saved in %.1fs", final, time.perf_counter() - t0)
    _barrier()
    return final


def _aside(step_dir: Path) -> Path:
    return step_dir.with_name(step_dir.name + OLD)


def _recover(root: Path) -> None:
    """Finish what an interrupted re-save left: ``step_N.old`` goes back to ``step_N`` when that
    is missing or incomplete (the swap stopped between its renames), else it is deleted."""
    for old in root.glob("step_*" + OLD):
        final = old.with_name(old.name[: -len(OLD)])
        if not _STEP_DIR.match(final.name) or not old.is_dir():
            continue
        if is_complete(final) or not is_complete(old):
            shutil.rmtree(old, ignore_errors=True)
            continue
        logger.warning("%s: restoring the checkpoint an interrupted re-save moved aside", final)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(old, final)
    fsync_dir(root)


def _prune(root: Path, keep_last: int) -> None:
    kept = set()
    for name in POINTERS:
        with contextlib.suppress(CheckpointError):  # names a missing directory: keeps nothing
            kept.add(read_pointer(root, name))
    for p in complete_checkpoints(root)[:-keep_last]:
        if p not in kept:
            shutil.rmtree(p, ignore_errors=True)
    for p in root.glob("step_*" + PARTIAL):
        shutil.rmtree(p, ignore_errors=True)


def read_latest(root: Path) -> Path | None:
    """The complete checkpoint that ``latest`` names, or None when there is no ``latest``."""
    return read_pointer(root, LATEST)


def set_best(root: Path, step: int | None) -> None:
    """Point ``best`` at ``step``'s directory, or remove it (``None``): rank 0, when a resume
    or a fresh start changes which checkpoint of ``root`` is the best of this run."""
    if step is not None:
        write_atomic(root / BEST, step_dir_name(step) + "\n")
    else:
        (root / BEST).unlink(missing_ok=True)


def read_pointer(root: Path, name: str) -> Path | None:
    """The complete checkpoint that the pointer file ``name`` (``latest``, ``best``) names, or
    None when there is no such file."""
    pointer = root / name
    if not pointer.is_file():
        return None
    target = root / pointer.read_text().strip()
    if not is_complete(target) and is_complete(_aside(target)):
        # A re-save of this step was interrupted between its two renames (or is swapping
        # right now): the previous copy, moved aside, is the complete one.
        return _aside(target)
    if not is_complete(target):
        raise CheckpointError(
            f"{pointer} names {target.name}, which is missing or incomplete; name a step "
            "directory instead (--resume DIR, export's --checkpoint DIR) or --resume none"
        )
    return target


def resolve(resume: str, root: Path) -> Path | None:
    """``auto`` -> latest (or None for a fresh run), ``none`` -> None, ``latest`` / ``best``
    -> what that pointer names (an error without one), else a checked path."""
    if resume == "none":
        return None
    if resume in POINTERS:
        if (path := read_pointer(root, resume)) is None:
            raise CheckpointError(
                f"{root} has no '{resume}' checkpoint (no {root / resume}): train first"
            )
        return path
    if resume == "auto":
        latest = read_latest(root)
        if latest is None and any(root.glob("step_*" + PARTIAL)):
            logger.warning("%s has only interrupted saves; starting fresh", root)
        return latest
    return check_complete(Path(resume))


def check_complete(path: Path) -> Path:
    """``path`` if it is a complete checkpoint, else CheckpointError saying why not."""
    if not path.is_dir():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not is_complete(path):
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no .metadata or {META}): its save was interrupted"
        )
    return path


def saved_metadata(path: Path) -> dict[str, Any]:
    """DCP's per-key metadata of a checkpoint; any read/unpickle failure makes it unusable."""
    try:
        return dict(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    except Exception as e:
        raise CheckpointError(f"checkpoint {path}: cannot read its DCP metadata ({e})") from None


def read_meta(path: Path) -> dict[str, Any]:
    try:
        meta: dict[str, Any] = json.loads((path / META).read_text())
        return meta
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / META}: unreadable ({e})") from None


def check_compatible(path: Path, meta: dict[str, Any], model_cfg: dict[str, Any]) -> None:
    """Raise CheckpointError naming the first model field that differs from the checkpoint's."""
    saved = meta.get("config", {}).get("model", {})
    preset = meta.get("config", {}).get("name", "")
    for key in SHAPE_FIELDS:
        if key in saved and saved[key] != model_cfg.get(key):
            # the model came from another preset than the checkpoint's: the fix is its config
            config = (
                f"its preset's config (PRESET={preset}, --config training/configs/{preset}.toml)"
                if preset and preset != "custom"
                else "the config it was trained with"
            )
            raise CheckpointError(
                f"checkpoint {path} has model.{key}={_short(saved[key])} but this config has "
                f"{_short(model_cfg.get(key))}: a resume keeps the model's shape, so give "
                f"{config}, or train a new model (another --run-dir, or --resume none)"
            )


def _short(v: Any) -> str:
    s = json.dumps(v)
    return s if len(s) <= 60 else s[:57] + "..."


def load(
    path: Path, state: dict[str, Any], table_rows: dict[str, int]
) -> tuple[dict[str, Any], list[str]]:
    """Load ``path`` into ``state`` (collective); returns the loaded state and skipped keys.

    Tensors whose saved shape matches are loaded by DCP, which reshards. Row-wise optimizer
    accumulators of column-sharded tables are converted (see module docstring). Optimizer
    states that have no counterpart (a table moved between data-parallel and a fused kernel)
    are left freshly initialized and returned so the caller can say so; a missing or
    mismatched *model* tensor is an error.
    """
    saved = saved_metadata(path)
    flat, mapping = flatten_state_dict(state)
    direct: dict[str, Any] = {}
    convert: list[str] = []
    skipped: list[str] = []
    for key, value in flat.items():
        md = saved.get(key)
        size = _size(value)
        if md is not None and (
            size is None or (isinstance(md, TensorStorageMetadata) and md.size == size)
        ):
            direct[key] = value
        elif (
            md is not None
            and isinstance(md, TensorStorageMetadata)
            and rowwise.rowwise_table(key, table_rows)
        ):
            convert.append(key)
        elif key.startswith("model."):
            raise CheckpointError(
                f"checkpoint {path} has no tensor '{key}' of shape {list(size or [])}: "
                "it was written by another model"
            )
        else:
            skipped.append(key)
    try:
        dcp.load(direct, checkpoint_id=str(path))
        for key in convert:
            table = rowwise.rowwise_table(key, table_rows)
            widths = rowwise.column_widths(path / PLAN, table)
            md = saved[key]
            assert isinstance(md, TensorStorageMetadata)
            rowwise.load_rowwise(path, key, md, flat[key], table_rows[table], widths)
    except CheckpointError:
        raise
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"checkpoint {path}: load failed: {first}") from None
    flat.update(direct)
    return unflatten_state_dict(flat, mapping), skipped


def _size(value: Any) -> torch.Size | None:
    if isinstance(value, ShardedTensor | torch.Tensor):
        return value.size()
    return None


def read_tensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint whose key starts with ``prefix``, whole, in this process.

    For inspection and tests (no process group needed); export loads through the model.
    """
    saved = saved_metadata(path)
    out = {
        k: torch.empty(md.size, dtype=md.properties.dtype)
        for k, md in saved.items()
        if k.startswith(prefix) and isinstance(md, TensorStorageMetadata)
    }
    dcp.load(out, checkpoint_id=str(path), no_dist=True)
    return out
