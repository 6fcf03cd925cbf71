"""Checkpoint -> mapped table files, one table in memory at a time.

The default export (``formats``: ``int8``, ``fp16``, ``fp32``) never builds the model with its
tables: the MLPs are read from the checkpoint into a :class:`PortableScorer` skeleton whose
tables take no memory, then each table is read alone through DCP (resharded from whatever world
size trained it) and written into every format's file (:class:`recsys_model.mapped.
TableWriter`) before the next is read. Peak memory: the largest table in fp32 plus its packed
copies, instead of every format of every table at once (7x the fp32 tables measured before).

``fp32`` is the model as trained (it rebuilds every other format and is the parity reference);
``int8`` is what a CPU worker serves, ``fp16`` what a GPU worker copies to its device, ``int4``
half of int8's bytes (``mixed``, a per-table mix by memory budget: training/export/budget.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from recsys_model.mapped import load_mapped, save_dense
from recsys_model.portable_model import PortableScorer
from recsys_model.table_writer import TableWriter
from recsys_stack.progress import progress as progress_bar
from training.checkpoint import store as checkpoint
from training.errors import CheckpointError
from training.export.portable import EBC, copy_dense, spec_of
from training.export.scorer import CHECKPOINT_PREFIX
from training.features import SPARSE_NAMES, table_name
from training.model import build_dlrm

logger = logging.getLogger("training.export")
MAPPED_FORMATS = ("int8", "int4", "fp16", "fp32")


def mapped_name(fmt: str) -> str:
    """The variant file of a mapped format (its tables: ``tables_<fmt>.bin``)."""
    return f"mapped_{fmt}.pt"


def _read(ckpt: Path, keys: Sequence[str]) -> dict[str, torch.Tensor]:
    """Whole tensors of ``keys`` (checkpoint names), read through DCP in this process."""
    saved = checkpoint.saved_metadata(ckpt)
    out = {}
    for key in keys:
        md = saved.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint {ckpt} lacks '{key}'")
        out[key] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load(out, checkpoint_id=str(ckpt), no_dist=True)
    return out


def dense_scorer(ckpt: Path, model_cfg: Any) -> PortableScorer:
    """A :class:`PortableScorer` with the checkpoint's MLPs and an unallocated table weight
    (``torch.empty``: no page is touched until written)."""
    dlrm = build_dlrm(model_cfg, device="meta")  # tables on meta, MLPs on CPU
    dense = [k for k in dlrm.state_dict() if not k.startswith(EBC)]
    state = _read(ckpt, [CHECKPOINT_PREFIX + k for k in dense])
    expected = dlrm.state_dict()
    for k in dense:
        got = state[CHECKPOINT_PREFIX + k]
        if got.shape != expected[k].shape:
            raise CheckpointError(
                f"checkpoint {ckpt}: '{k}' has shape {list(got.shape)} but its config gives "
                f"{list(expected[k].shape)}: the tensors belong to another model"
            )
    dlrm.load_state_dict({k: state[CHECKPOINT_PREFIX + k] for k in dense}, strict=False)
    scorer = PortableScorer(spec_of(model_cfg))  # its table weight: torch.empty, untouched
    copy_dense(dlrm, scorer)
    return scorer.eval()


def write_mapped(
    ckpt: Path, model_cfg: Any, out: Path, formats: Sequence[str], progress: bool = False
) -> dict[str, Path]:
    """Every format's ``mapped_<fmt>.pt`` + ``tables_<fmt>.bin`` in ``out``, streamed table by
    table from ``ckpt``; returns ``{format: mapped file}``."""
    scorer = dense_scorer(ckpt, model_cfg)
    rows, dim = [int(r) for r in scorer.spec["rows"]], int(scorer.spec["dim"])
    writers = {f: TableWriter(out / f"tables_{f}.bin", sum(rows), dim, f) for f in formats}
    start = 0
    bar = progress_bar(total=len(rows), desc="tables", unit="table", disable=not progress)
    for feature, n in zip(SPARSE_NAMES, rows, strict=True):
        key = f"{CHECKPOINT_PREFIX}{EBC}.{table_name(feature)}.weight"
        table = _read(ckpt, [key])[key]
        if list(table.shape) != [n, dim]:
            raise CheckpointError(
                f"checkpoint {ckpt}: '{key}' has shape {list(table.shape)}, its config [{n}, {dim}]"
            )
        for w in writers.values():
            w.write(start, table)
        start += n
        del table
        bar.update(1)
    bar.close()
    files = {}
    for fmt, w in writers.items():
        files[fmt] = out / mapped_name(fmt)
        save_dense(files[fmt], scorer, w.close())
    return files


def load_formats(files: dict[str, Path]) -> dict[str, Any]:
    """The mapped scorers of ``files`` on CPU (fp16 computes in fp16 there: slow but exact to
    what a GPU computes, which is what parity must judge)."""
    return {f: load_mapped(p, torch.device("cpu"), verify=False) for f, p in files.items()}
