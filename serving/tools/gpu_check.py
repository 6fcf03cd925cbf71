"""Device check of the portable export: ``python -m serving.tools.gpu_check --export runs/demo/export``.

Needs torch and the standard library only (no numpy, fbgemm or TorchRec), so that it runs on a
borrowed CUDA machine with the repository copied and no venv. It

1. loads each portable variant (TorchScript fp32/fp16, the ``torch.export`` program, and the
   module rebuilt from ``portable_state.pt`` with this machine's torch) on CPU and checks it
   against the export's eager probabilities in ``sample.npz`` (fp32: max |Δp| <= 1e-5;
   fp16/bf16: |ΔAUC| <= 1e-3);
2. with CUDA: the same on ``cuda:0`` (bf16 cast from fp32 at load, as the handler does), and the
   handler's model stages (variant choice, ``ScoringModel`` load + forward of two requests;
   skipped with a note where numpy is missing);
3. prints p50 latency and throughput for each variant and batch size (1 to 8,192).

Without CUDA it says so and runs the CPU half. Exit code 1 when a parity check fails.
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

from recsys_stack.config import ConfigError, parse
from serving.worker.portable_model import from_state

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
    """Export directory (schema.json, sample.npz and the portable files)."""
    batches: list[int] = field(default_factory=lambda: [1, 8, 64, 512, 2048, 8192])
    """Batch sizes of the latency table (built by repeating the sample's rows)."""
    iters: int = 20
    """Timed forwards per cell, after 3 warm-up forwards."""
    cpu_max_batch: int = 2048
    """Largest batch timed on CPU (the CPU half is a smoke run, not the measurement)."""
    aoti: bool = False
    """Also AOTInductor-compile the .pt2 for each device here and time it (needs a C++
    compiler; on CUDA, Triton): minutes of compile."""


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
    """ROC AUC (Mann-Whitney, ties averaged)."""
    s = scores.double()
    _, inverse, counts = torch.unique(s, return_inverse=True, return_counts=True)
    ends = torch.cumsum(counts, 0).double()
    ranks = (ends - (counts.double() - 1) / 2)[inverse]  # average 1-based rank per tie group
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def compile_aoti(export: Path, device: torch.device, out: Path) -> Any:
    """The ``.pt2`` program AOTInductor-compiled for ``device`` here, loaded."""
    from torch._inductor import aoti_compile_and_package, aoti_load_package
    from torch.export.passes import move_to_device_pass

    program = move_to_device_pass(torch.export.load(export / "model_portable.pt2"), device)
    t0 = time.perf_counter()
    path = aoti_compile_and_package(program, package_path=str(out / f"aoti_{device.type}.pt2"))
    print(f"AOTInductor compile for {device}: {time.perf_counter() - t0:.0f} s")
    return aoti_load_package(path)


def load_models(export: Path, schema: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Every torch-loadable portable variant on ``device`` (name -> callable)."""
    from serving.worker.scoring import load_artifact

    models: dict[str, Any] = {}
    for name, info in schema["variants"].items():
        if info.get("requires") != ["torch"] or info.get("device") != "any":
            continue  # TorchRec's (fbgemm), ONNX, and AOTInductor packages built for the CPU
        try:
            models[name] = load_artifact(export / info["file"], info, device, None)
        except Exception as e:  # a file from a newer torch: say so, rebuild from the state
            logger.warning("%s: cannot load %s here: %s", name, info["file"], e)
        if name == "portable" and device.type == "cuda":
            models["portable_bf16"] = load_artifact(
                export / info["file"], info, device, torch.bfloat16
            )
    state = torch.load(export / "portable_state.pt", map_location="cpu", weights_only=True)
    models["rebuilt"] = from_state(state).to(device)
    return models


def parity(
    models: dict[str, Any], sample: dict[str, torch.Tensor], device: torch.device
) -> list[tuple[str, str, float, float, bool]]:
    """``(model, check, value, limit, ok)`` of each model against the export's eager probs."""
    ref, labels = sample["probs_eager"], sample["labels"]
    x = tuple(t.to(device) for t in (sample["dense"], sample["values"], sample["lengths"]))
    ref_auc, rows = auc(labels, ref), []
    with torch.inference_mode():
        for name, model in models.items():
            p = model(*x).float().cpu()
            if "fp16" in name or "bf16" in name:
                value, limit, what = abs(auc(labels, p) - ref_auc), MAX_AUC_DROP, "|ΔAUC|"
            else:
                value, limit, what = float((p - ref).abs().max()), MAX_ABS_DIFF_FP32, "max |Δp|"
            rows.append((name, what, value, limit, value <= limit))
    return rows


def handler_stages(export: Path, schema: dict[str, Any], sample: dict[str, torch.Tensor]) -> str:
    """The handler's choice and ``ScoringModel`` on CUDA: two requests in one forward."""
    try:
        from serving.worker.scoring import ScoringModel, choose_variant, slice_examples
    except ImportError as e:
        return f"handler stages: skipped ({e}; pip install numpy to run them)"
    device = torch.device("cuda:0")
    default = schema["variants"][schema["served_variant"]]["file"]
    variant, artifact, dtype = choose_variant(schema, default, device, {})
    model = ScoringModel(export, artifact, device, dtype)
    x = (sample["dense"], sample["values"], sample["lengths"])
    n = x[0].shape[0]
    parts = model.forward([slice_examples(*x, 0, n // 3), slice_examples(*x, n // 3, n)])
    p = torch.cat(parts)
    diff = abs(auc(sample["labels"], p) - auc(sample["labels"], sample["probs_eager"]))
    ok = diff <= MAX_AUC_DROP and p.shape[0] == n
    return f"handler stages on {device}: {variant} ({artifact}) |ΔAUC| {diff:.1e} {'ok' if ok else 'FAIL'}"


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
    devices = [torch.device("cpu")] + ([torch.device("cuda:0")] if cuda else [])
    failed = 0
    for device in devices:
        models = load_models(cfg.export, schema, device)
        if cfg.aoti:
            with tempfile.TemporaryDirectory() as tmp:
                models["aoti"] = compile_aoti(cfg.export, device, Path(tmp))
        for name, what, value, limit, ok in parity(models, sample, device):
            failed += not ok
            print(
                f"{'ok  ' if ok else 'FAIL'} {device} {name:<15} {what} = {value:.2e} (limit {limit:.0e})"
            )
        if device.type == "cuda":
            print(handler_stages(cfg.export, schema, sample))
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
        if "portable" not in variants:
            raise ConfigError(f"{cfg.export} has no portable variant: export with portable = true")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return check(cfg)


if __name__ == "__main__":
    sys.exit(main())
