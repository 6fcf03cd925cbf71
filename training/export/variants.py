"""The export's variants: what each format writes, loaded back for parity, and their schema
records.

The mapped formats (``int8``, ``fp16``, ``fp32``) are streamed from the checkpoint table by table
(:mod:`training.export.stream`). The others need the model whole in memory: TorchRec's DLRM is
loaded only for them, or when the tables are small enough that checking against TorchRec's own
eager model costs little (``eager_check_bytes``). The parity reference is that eager model when
it is loaded, else the streamed fp32 tables (the checkpoint's weights, unchanged).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from recsys_model.mapped import sha256
from training.data.loader import Arrays
from training.export.budget import write_mixed
from training.export.portable import PORTABLE, load_variant, portable_scorer, save_portable
from training.export.scorer import eager_scorer, load_dlrm, raw_inputs, script_variant
from training.export.stream import MAPPED_FORMATS, load_formats, write_mapped

logger = logging.getLogger("training.export")
# TorchRec's TorchScript files (the ``torchscript`` format): variant -> (file, precision)
TORCHSCRIPT = {"ts_fp32": ("model_fp32.pt", "fp32"), "ts_int8": ("model_int8.pt", "int8")}


@dataclass
class Variants:
    """What was written (``files``), loaded back (``models``), and the parity reference."""

    files: dict[str, Path] = field(default_factory=dict)
    models: dict[str, Any] = field(default_factory=dict)
    reference: str = "fp32"
    """``eager`` (TorchRec's model) or ``fp32`` (the streamed tables)."""
    reference_model: Any = None
    budget: dict[str, Any] | None = None
    """schema.json's ``memory_budget`` (the ``mixed`` variant's per-table choice), if asked."""


def fp32_table_bytes(model_cfg: Any) -> int:
    return sum(model_cfg.rows()) * model_cfg.embedding_dim * 4


def build(
    ckpt: Path,
    cfg: Any,
    out: Path,
    formats: list[str],
    arrays: Arrays,
    eager_check_bytes: int,
    progress: bool = False,
    memory_budget: int = 0,
) -> Variants:
    """Write every format of ``formats`` into ``out`` and load each back (CPU); with a
    ``memory_budget``, the ``mixed`` tables too (:mod:`training.export.budget`)."""
    v = Variants()
    t0 = time.perf_counter()
    mapped = [f for f in MAPPED_FORMATS if f in formats or f == "fp32"]  # fp32: the reference
    v.files.update(write_mapped(ckpt, cfg.model, out, mapped, progress=progress))
    v.models.update(load_formats(v.files))
    logger.info("mapped tables %s written in %.1f s", ", ".join(mapped), time.perf_counter() - t0)
    if memory_budget:
        v.files["mixed"], v.budget = write_mixed(v.models["fp32"], arrays, out, memory_budget)
        v.models.update(load_formats({"mixed": v.files["mixed"]}))
    whole = {f for f in formats if f not in MAPPED_FORMATS}
    if not whole and fp32_table_bytes(cfg.model) > eager_check_bytes:
        v.reference_model = v.models["fp32"]
        return v
    dlrm = load_dlrm(ckpt)[0]
    v.reference, v.reference_model = "eager", eager_scorer(dlrm, cfg)
    if "torchscript" in whole:
        for name, (file, precision) in TORCHSCRIPT.items():
            v.files[name] = out / file
            script_variant(dlrm, cfg, precision).save(str(v.files[name]))  # type: ignore[arg-type]
            v.models[name] = torch.jit.load(str(v.files[name]))
    if whole - {"torchscript"}:
        t0 = time.perf_counter()
        example = raw_inputs(arrays.dense[:64], arrays.sparse[:64])
        portable = save_portable(portable_scorer(dlrm, cfg.model), out, example, whole)
        logger.info("portable variants written in %.1f s", time.perf_counter() - t0)
        v.files.update(portable)
        v.models.update({n: load_variant(p, PORTABLE[n][1]) for n, p in portable.items()})
    return v


def info(variant: str, path: Path) -> dict[str, Any]:
    """Size, checksum, kind, what loading it needs, its device and precision, for
    schema.json's ``variants`` (a mapped variant also names its tables file)."""
    if variant in (*MAPPED_FORMATS, "mixed"):
        tables = torch.load(path, map_location="cpu", weights_only=True)["tables"]
        kind, requires, dtype = "mapped", ["torch"], variant
    elif variant in TORCHSCRIPT:
        tables, kind, dtype = None, "torchscript", TORCHSCRIPT[variant][1]
        requires = ["torch", "fbgemm_gpu"]
    else:
        tables, kind = None, PORTABLE[variant][1]
        requires = ["onnxruntime"] if kind == "onnx" else ["torch"]
        dtype = "fp16" if variant.endswith("fp16") else "fp32"
    # CPU only: TorchRec's TorchScript (fbgemm CPU kernels), AOTInductor packages (compiled for
    # this machine's CPU) and the quantized tables (torch's rowwise kernels are CPU only)
    cpu_only = kind == "aoti" or variant in TORCHSCRIPT or variant in ("int8", "int4", "mixed")
    record = {
        "file": path.name, "bytes": path.stat().st_size, "sha256": sha256(path), "kind": kind,
        "requires": requires, "device": "cpu" if cpu_only else "any", "dtype": dtype,
    }  # fmt: skip
    if tables is not None:
        keys = ("file", "format", "bytes", "sha256", "formats")
        record["tables"] = {k: tables[k] for k in keys if k in tables}
    return record


def archived(files: dict[str, Path], served: str, cuda: tuple[str, ...]) -> list[Path]:
    """The variant files the .mar carries: what CPU workers serve and what CUDA ones load,
    with their tables files."""
    out = []
    for name in dict.fromkeys((served, *cuda)):
        path = files[name]
        out.append(path)
        if name in (*MAPPED_FORMATS, "mixed"):
            out.append(path.parent / f"tables_{name}.bin")
    return out
