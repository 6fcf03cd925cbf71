"""Device check of an export: ``python -m serving.tools.gpu_check --export runs/demo/export``.

Needs torch and the standard library only (no numpy, fbgemm or TorchRec), so that it runs on a
borrowed CUDA machine with the repository copied and no venv. It

1. loads, on CPU, every variant that torch alone loads on any device and checks it against the
   export's reference probabilities in ``sample.npz`` (``probs_eager``, else ``probs_fp32``; fp32:
   max |Δp| <= 1e-5; fp16/bf16: |ΔAUC| <= 1e-3): the mapped ``fp16`` tables (what CUDA workers
   load) and the mapped ``fp32`` tables (the model as trained) when they are in the folder, each
   table file checked against schema.json's size and sha256 first (``recsys_model.mapped.
   load_mapped``); and, for an export with the ``portable`` format, its TorchScript fp32/fp16,
   the ``torch.export`` program and the module rebuilt from ``portable_state.pt`` with this
   machine's torch;
2. with CUDA: the same on ``cuda:0`` (the tables copied to the device; bf16 cast at load, as the
   handler does);
3. on each device, the handler's model stages: the variant ``choose_variant`` picks there (CPU:
   the archived one, the int8 tables by default; CUDA: ``serving.cuda``), ``ScoringModel`` load,
   one forward of the sample as one batch and one of each of two slices of it (``slice_examples``;
   the scores of the slices must be the batch's: max |Δp| in fp32, |ΔAUC| in reduced precision);
4. prints p50 latency and throughput for each model and batch size (1 to 8,192).

Without CUDA it says so and runs the CPU half. Exit code 1 when a check fails.
"""

import ast
import json
import logging
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from recsys_model.portable_model import from_state
from recsys_stack.config import ConfigError, parse
from recsys_stack.metrics import roc_auc

logger = logging.getLogger("serving.tools.gpu_check")
Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
MAX_ABS_DIFF_FP32 = 1e-5  # the export's gates (training/export/parity.py)
MAX_AUC_DROP = 1e-3
_NPY_DTYPES = {
    "<f4": torch.float32, "<f8": torch.float64, "<i8": torch.int64, "<i4": torch.int32,
    "|i1": torch.int8, "|u1": torch.uint8, "|b1": torch.bool,
}  # fmt: skip


@dataclass
class GpuCheckConfig:
    """Which export to check, and how long to time it."""

    export: Path = Path("runs/demo/export")
    """Export directory (schema.json, sample.npz and the variant files: mapped_fp16.pt +
    tables_fp16.bin, and whatever else the export wrote)."""
    batches: list[int] = field(default_factory=lambda: [1, 8, 64, 512, 2048, 8192])
    """Batch sizes of the latency table (built by repeating the sample's rows)."""
    iters: int = 20
    """Timed forwards per cell, after 3 warm-up forwards."""
    cpu_max_batch: int = 2048
    """Largest batch timed on CPU (the CPU half is a smoke run, not the measurement)."""
    aoti: bool = False
    """Also AOTInductor-compile the .pt2 (an export with the ``pt2`` format) for each device
    here and time it (needs a C++ compiler; on CUDA, Triton): minutes of compile."""


def read_npz(path: Path) -> dict[str, torch.Tensor]:
    """``np.savez`` arrays as tensors, read with the standard library (no numpy)."""
    out = {}
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            raw = z.read(name)
            header_len = int.from_bytes(raw[8:10], "little")  # .npy format version 1
            header = ast.literal_eval(raw[10 : 10 + header_len].decode("latin1"))
            if header["descr"] not in _NPY_DTYPES or header["fortran_order"]:
                raise ValueError(f"{path}:{name}: unsupported array {header['descr']}")
            data = bytearray(raw[10 + header_len :])
            t = torch.frombuffer(data, dtype=_NPY_DTYPES[header["descr"]]) if data else None
            shape = tuple(header["shape"])
            empty = torch.empty(shape, dtype=_NPY_DTYPES[header["descr"]])
            out[name.removesuffix(".npy")] = empty if t is None else t.reshape(shape)
    return out


def take(sample: dict[str, torch.Tensor], batch: int) -> Tensors:
    """The first ``batch`` examples of the sample, repeated as needed (feature-major ids)."""
    dense, values, lengths = sample["dense"], sample["values"], sample["lengths"]
    rows = dense.shape[0]
    idx = torch.arange(batch) % rows
    bags = torch.split(values, lengths.reshape(-1).tolist())  # f * rows + example
    feats = lengths.shape[0]
    picked = [bags[f * rows + int(i)] for f in range(feats) for i in idx]
    return dense[idx].contiguous(), torch.cat(picked), lengths[:, idx].contiguous()


def auc(labels: torch.Tensor, scores: torch.Tensor) -> float:
    """ROC AUC (:func:`recsys_stack.metrics.roc_auc`, torch only), NaN without both labels."""
    try:
        return roc_auc(labels, scores)
    except ValueError:
        return float("nan")


def compile_aoti(export: Path, device: torch.device, out: Path) -> Any:
    """The ``.pt2`` program AOTInductor-compiled for ``device`` here, loaded."""
    from torch._inductor import aoti_compile_and_package, aoti_load_package
    from torch.export.passes import move_to_device_pass

    program = move_to_device_pass(torch.export.load(export / "model_portable.pt2"), device)
    t0 = time.perf_counter()
    path = aoti_compile_and_package(program, package_path=str(out / f"aoti_{device.type}.pt2"))
    print(f"AOTInductor compile for {device}: {time.perf_counter() - t0:.0f} s")
    return aoti_load_package(path)


def check_tables(export: Path, name: str, info: dict[str, Any]) -> str | None:
    """Why mapped variant ``name`` cannot be checked here (a file missing: the fp32 tables are
    not archived and may be left behind), else None. Raises ValueError when its table file
    is not the one the export wrote (size, sha256)."""
    from recsys_model.mapped import sha256

    record = info["tables"]
    missing = [f for f in (info["file"], record["file"]) if not (export / f).is_file()]
    if missing:
        return f"{', '.join(missing)} not in {export}"
    tables = export / record["file"]
    if tables.stat().st_size != record["bytes"] or sha256(tables) != record["sha256"]:
        raise ValueError(f"{tables}: size or sha256 differs from schema.json's (a bad copy?)")
    return None


def load_models(
    export: Path, schema: dict[str, Any], device: torch.device
) -> tuple[dict[str, Any], list[str]]:
    """Every variant torch alone loads on any device, on ``device`` (name -> callable), and a
    note for each one skipped."""
    from recsys_model.mapped import load_mapped
    from serving.worker.scoring import load_artifact

    models: dict[str, Any] = {}
    notes: list[str] = []
    for name, info in schema["variants"].items():
        if info.get("requires") != ["torch"] or info.get("device") != "any":
            continue  # int8 tables (a CPU kernel), TorchRec's (fbgemm), ONNX, AOTInductor for CPU
        if info.get("kind") == "mapped":  # the tables, mapped (CPU) or copied to the device
            why = check_tables(export, name, info)
            if why:
                notes.append(f"skip {device} {name}: {why}")
                continue
            models[name] = load_mapped(export / info["file"], device, verify=False)
            if name == "fp16" and device.type == "cuda":  # RECSYS_CUDA_DTYPE=bf16: a cast
                models["fp16_bf16"] = load_mapped(export / info["file"], device, verify=False).to(
                    torch.bfloat16
                )
            continue
        try:
            models[name] = load_artifact(export / info["file"], info, device, None)
        except Exception as e:  # a file from a newer torch: say so, rebuild from the state
            logger.warning("%s: cannot load %s here: %s", name, info["file"], e)
        if name == "portable" and device.type == "cuda":
            models["portable_bf16"] = load_artifact(
                export / info["file"], info, device, torch.bfloat16
            )
    if (export / "portable_state.pt").is_file():  # the portable format's plain weights
        state = torch.load(export / "portable_state.pt", map_location="cpu", weights_only=True)
        models["rebuilt"] = from_state(state).to(device)
    return models, notes


def reference(sample: dict[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
    """The export's reference probabilities: TorchRec's eager model where it was built, else
    the fp32 tables (a model too large for it)."""
    name = "eager" if "probs_eager" in sample else "fp32"
    return name, sample[f"probs_{name}"]


def reduced(name: str) -> bool:
    """Judged by |ΔAUC| (reduced precision) rather than max |Δp|."""
    return any(p in name for p in ("fp16", "bf16", "int8"))


def parity(
    models: dict[str, Any], sample: dict[str, torch.Tensor], device: torch.device
) -> list[tuple[str, str, float, float, bool]]:
    """``(model, check, value, limit, ok)`` of each model against the export's reference."""
    (ref_name, ref), labels = reference(sample), sample["labels"]
    x = tuple(t.to(device) for t in (sample["dense"], sample["values"], sample["lengths"]))
    ref_auc, rows = auc(labels, ref), []
    with torch.inference_mode():
        for name, model in models.items():
            p = model(*x).float().cpu()
            if reduced(name):
                value, limit = abs(auc(labels, p) - ref_auc), MAX_AUC_DROP
                what = f"|ΔAUC| vs {ref_name}"
            else:
                value, limit = float((p - ref).abs().max()), MAX_ABS_DIFF_FP32
                what = f"max |Δp| vs {ref_name}"
            rows.append((name, what, value, limit, value <= limit))
    return rows


def handler_stages(
    export: Path, schema: dict[str, Any], sample: dict[str, torch.Tensor], device: torch.device
) -> tuple[str, bool]:
    """The handler's choice and ``ScoringModel`` on ``device``: the sample scored as one batch
    (against the export's reference) and as two slices (against that batch). Returns the report
    line and whether it passed (a skip passes)."""
    from serving.worker.scoring import ScoringModel, choose_variant, slice_examples

    default = schema["variants"][schema["served_variant"]]["file"]
    variant, artifact, dtype = choose_variant(schema, default, device, {})
    head = f"handler stages on {device}: {variant} ({artifact}{f', {dtype}' if dtype else ''})"
    if not (export / artifact).is_file():
        return f"{head}: skipped ({artifact} not in {export})", True
    try:
        model = ScoringModel(export, artifact, device, dtype)
    except ImportError as e:  # TorchRec's TorchScript needs fbgemm
        return f"{head}: skipped ({e})", True
    x = (sample["dense"], sample["values"], sample["lengths"])
    n, labels = x[0].shape[0], sample["labels"]
    p = model.forward(x)
    cut = torch.cat([model.forward(slice_examples(*x, 0, n // 3)),
                     model.forward(slice_examples(*x, n // 3, n))])  # fmt: skip
    if p.shape[0] != n or cut.shape[0] != n:
        return f"{head}: {p.shape[0]} and {cut.shape[0]} scores for {n} examples FAIL", False
    ref_name, ref = reference(sample)
    diff = abs(auc(labels, p) - auc(labels, ref))
    if dtype is not None or reduced(variant):  # reduced precision: judged by the ranking
        what, value, limit = "|ΔAUC|", abs(auc(labels, cut) - auc(labels, p)), MAX_AUC_DROP
    else:
        what, value, limit = "max |Δp|", float((cut - p).abs().max()), MAX_ABS_DIFF_FP32
    ok = diff <= MAX_AUC_DROP and value <= limit
    line = f"{head} |ΔAUC| vs {ref_name} {diff:.1e}, two slices' {what} vs the batch {value:.1e}"
    return f"{line} {'ok' if ok else 'FAIL'}", ok


def latency(
    models: dict[str, Any],
    sample: dict[str, torch.Tensor],
    device: torch.device,
    cfg: GpuCheckConfig,
) -> list[str]:
    """Table rows: p50 ms and examples/s per model and batch size."""
    batches = [b for b in cfg.batches if device.type == "cuda" or b <= cfg.cpu_max_batch]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    head = f"{'model':<15}" + "".join(f"{'batch ' + str(b):>22}" for b in batches)
    lines = [f"latency on {device}: p50 ms / examples per s", head]
    inputs = {b: tuple(t.to(device) for t in take(sample, b)) for b in batches}
    with torch.inference_mode():
        for name, model in models.items():
            cells = []
            for b in batches:
                times = []
                for i in range(cfg.iters + 3):
                    sync()
                    t0 = time.perf_counter()
                    model(*inputs[b])
                    sync()
                    if i >= 3:
                        times.append(time.perf_counter() - t0)
                p50 = sorted(times)[len(times) // 2]
                cells.append(f"{p50 * 1e3:>9.3f} / {b / p50:>10,.0f}")
            lines.append(f"{name:<15}" + "".join(f"{c:>22}" for c in cells))
    return lines


def check(cfg: GpuCheckConfig) -> int:
    """Run the check; prints its report, returns the exit code."""
    schema = json.loads((cfg.export / "schema.json").read_text())
    sample = read_npz(cfg.export / "sample.npz")
    cuda = torch.cuda.is_available()
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}: ", end="")
    if cuda:
        print(f"{torch.cuda.device_count()} device(s), {torch.cuda.get_device_name(0)}")
    else:
        print("CUDA is not available here: running the CPU half only")
    print(
        f"reference: the export's probs_{reference(sample)[0]} ({sample['labels'].shape[0]} rows)"
    )
    devices = [torch.device("cpu")] + ([torch.device("cuda:0")] if cuda else [])
    failed = 0
    for device in devices:
        try:
            models, notes = load_models(cfg.export, schema, device)
        except ValueError as e:  # a table file that is not the export's
            print(f"FAIL {device} {e}")
            failed += 1
            continue
        if cfg.aoti:
            with tempfile.TemporaryDirectory() as tmp:
                models["aoti"] = compile_aoti(cfg.export, device, Path(tmp))
        for note in notes:
            print(note)
        for name, what, value, limit, ok in parity(models, sample, device):
            failed += not ok
            print(
                f"{'ok  ' if ok else 'FAIL'} {device} {name:<15} {what} = {value:.2e} (limit {limit:.0e})"
            )
        line, ok = handler_stages(cfg.export, schema, sample, device)
        failed += not ok
        print(line)
        print("\n".join(latency(models, sample, device, cfg)))
    print(f"gpu-check: {'ok' if not failed else f'{failed} check(s) FAILED'}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = parse(
            GpuCheckConfig, argv, "python -m serving.tools.gpu_check", __doc__.split("\n\n")[0]
        )
        if not (cfg.export / "schema.json").is_file():
            raise ConfigError(f"{cfg.export / 'schema.json'} not found: run `make export` first")
        variants = json.loads((cfg.export / "schema.json").read_text()).get("variants", {})
        if not any(i.get("requires") == ["torch"] and i.get("device") == "any"
                   for i in variants.values()):  # fmt: skip
            raise ConfigError(
                f"{cfg.export} has no variant torch loads on a GPU (the mapped fp16 tables, or "
                "the portable format): export with the default formats"
            )
        if cfg.aoti and "portable_pt2" not in variants:
            raise ConfigError(
                f"--aoti compiles the pt2 program, which {cfg.export} lacks: export with "
                """--formats '["int8", "fp16", "pt2"]'"""
            )
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return check(cfg)


if __name__ == "__main__":
    sys.exit(main())
