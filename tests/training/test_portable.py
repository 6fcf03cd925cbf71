"""The portable variants (the ``portable``, ``pt2``, ``onnx`` and ``aoti`` export formats, written
on request): TorchRec DLRM weights in a pure-PyTorch scorer, saved as TorchScript, a torch.export
program and ONNX, loadable with torch alone (onnxruntime for ONNX)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from recsys_model.portable_model import PortableScorer, from_state, to_state
from training.config import ModelConfig
from training.errors import ConfigError
from training.export.config import ExportConfig, check_cuda_int8
from training.export.portable import load_variant, portable_scorer, save_portable
from training.export.scorer import eager_scorer
from training.model import build_dlrm

ROOT = Path(__file__).resolve().parents[2]


def _inputs(batch: int, rows: int = 50, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Raw inputs with empty bags, several ids per bag and ids far above the table size."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (26, batch), generator=g, dtype=torch.int32)
    values = torch.randint(0, 50 * rows, (int(lengths.sum()),), generator=g)
    dense = torch.randint(-2, 100, (batch, 13), generator=g).float()
    return dense, values, lengths


@pytest.mark.parametrize("arch", ["dlrm", "dlrm_dcn"])
def test_portable_scorer_equals_the_torchrec_scorer(arch: str) -> None:
    cfg = type("Cfg", (), {})()
    cfg.model = ModelConfig(
        arch=arch, embedding_dim=4, num_embeddings=50, dense_arch=[8, 4], over_arch=[8, 1],
        dcn_num_layers=2, dcn_low_rank_dim=3,
    )  # fmt: skip
    torch.manual_seed(0)
    dlrm = build_dlrm(cfg.model, device="cpu").eval()
    for p in dlrm.parameters():  # TorchRec initializes tables uniformly: make them all differ
        torch.nn.init.normal_(p, std=0.3)
    eager = eager_scorer(dlrm, cfg)
    with torch.no_grad():
        for bags in ("embedding_bag", "scatter"):
            portable = portable_scorer(dlrm, cfg.model, bags=bags)
            for batch in (1, 7):
                x = _inputs(batch, seed=batch)
                assert torch.allclose(portable(*x), eager(*x), atol=1e-6), (bags, batch)
        rebuilt = from_state(to_state(portable))
        assert torch.equal(rebuilt(*x), portable(*x))


def test_bag_modes_agree_on_all_empty_and_single_id_bags() -> None:
    spec = {"rows": [5] * 26, "dim": 3, "num_dense": 13, "dense_arch": [4, 3], "over_arch": [2, 1],
            "arch": "dlrm"}  # fmt: skip
    torch.manual_seed(1)
    a = PortableScorer(spec).eval()
    torch.nn.init.normal_(a.weight)
    b = from_state(to_state(a), bags="scatter")
    dense = torch.rand(3, 13)
    empty = (dense, torch.zeros(0, dtype=torch.int64), torch.zeros(26, 3, dtype=torch.int32))
    ones = torch.ones(26, 3, dtype=torch.int32)
    single = (dense, torch.arange(78, dtype=torch.int64) * 7, ones)
    with torch.no_grad():
        for x in (empty, single):
            assert torch.allclose(a(*x), b(*x), atol=1e-6)
        assert not torch.allclose(a(*empty), a(*single))  # the ids do reach the output
    with pytest.raises(ValueError, match="bags = 'loop'"):
        PortableScorer(spec, bags="loop")


@pytest.mark.timeout(2400)  # a C++ compile: 67 s quiet, past the suite's 900 s at load 20-35
def test_aoti_package_loads_and_matches(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The AOTInductor switch, once, on a model small enough to compile in seconds."""
    import torch._inductor.config as inductor

    # one compile in this process: inductor's pool of compile workers (one per core) costs
    # more to start than this model's few kernels take to build (62 vs 99 s, busy 2-core box)
    monkeypatch.setattr(inductor, "compile_threads", 1)
    spec = {"rows": [11] * 26, "dim": 4, "num_dense": 13, "dense_arch": [8, 4],
            "over_arch": [8, 1], "arch": "dlrm"}  # fmt: skip
    model = PortableScorer(spec).eval()
    torch.nn.init.normal_(model.weight)
    files = save_portable(model, tmp_path, _inputs(5, rows=11), {"aoti"})
    assert set(files) == {"portable_aoti"}  # only the format asked for
    compiled = load_variant(files["portable_aoti"], "aoti")
    x = _inputs(9, rows=11, seed=3)  # another batch size: the batch is dynamic
    with torch.no_grad():
        assert torch.allclose(compiled(*x), model(*x), atol=1e-5)


def test_cuda_int8_is_refused_with_what_to_install() -> None:
    with pytest.raises(ConfigError, match=r"needs a CUDA GPU"):
        check_cuda_int8(cuda_available=False)
    with pytest.raises(ConfigError, match=r"pip install fbgemm-gpu==1\.8\.0"):
        check_cuda_int8(cuda_available=True)  # this machine has the CPU build only
    # aoti is a format of its own now: it needs no other
    ExportConfig(run_dir=Path("x"), formats=["int8", "aoti"]).validate()


PORTABLE_FILES = (
    "model_portable.pt", "model_portable_fp16.pt", "model_portable.pt2", "model_portable.onnx",
    "portable_state.pt",
)  # fmt: skip


@pytest.mark.slow
def test_export_records_gates_and_archives_the_portable_variants(
    exported_portable: tuple[Path, Path, str], exported: tuple[Path, Path, str]
) -> None:
    export, store, report = exported_portable
    schema = json.loads((export / "schema.json").read_text())
    parity = json.loads((export / "parity.json").read_text())
    assert set(schema["variants"]) == {
        "int8", "fp32", "portable", "portable_fp16", "portable_pt2", "portable_onnx",
    }  # fmt: skip
    for name in ("portable", "portable_fp16", "portable_pt2", "portable_onnx"):
        info = schema["variants"][name]
        data = (export / info["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == info["sha256"] and len(data) == info["bytes"]
        assert info["requires"] == (["onnxruntime"] if name == "portable_onnx" else ["torch"])
        assert info["device"] == "any", name  # torch alone loads them on a GPU too
        (check,) = [c for c in parity["checks"] if c["variant"] == name]
        assert check["ok"] and check["limit"] == (1e-3 if name == "portable_fp16" else 1e-5)
    assert parity["reference"] == "eager"  # the whole model was loaded for these formats
    assert (export / "portable_state.pt").is_file()
    int8 = schema["variants"]["int8"]
    assert int8["kind"] == "mapped" and int8["requires"] == ["torch"] and int8["device"] == "cpu"
    # no fp16 tables asked for: CUDA workers load the portable TorchScript pair
    assert schema["serving"]["cpu"] == "int8" and schema["serving"]["cuda"] == "portable"
    names = set(zipfile.ZipFile(store / "dlrm-tiny-1.0.mar").namelist())
    assert {
        "mapped_int8.pt", "tables_int8.bin", "model_portable.pt", "model_portable_fp16.pt",
    } <= names  # fmt: skip
    assert "model_portable.onnx" not in names  # ONNX is for other servers, not TorchServe
    assert "ONNX (onnxruntime) / mapped fp32 at batch 100:" in report
    for model in ("portable_fp16", "portable_pt2", "portable_onnx"):
        assert f"\n{model} " in report.split("in-process latency")[1]
    # the default export writes none of them: they are asked for with --formats
    default, _, _ = exported
    assert not [f for f in PORTABLE_FILES if (default / f).exists()]


FRESH = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    from serving.tools.gpu_check import auc, read_npz

    export = Path(sys.argv[1])
    schema = json.loads((export / "schema.json").read_text())
    s = read_npz(export / "sample.npz")
    x = (s["dense"], s["values"], s["lengths"])
    ref = s["probs_eager"]
    out = {}
    with torch.inference_mode():
        for name in ("portable", "portable_fp16"):
            p = torch.jit.load(str(export / schema["variants"][name]["file"]))(*x).float()
            out[name] = [float((p - ref).abs().max()), abs(auc(s["labels"], p) - auc(s["labels"], ref))]
        p = torch.export.load(export / "model_portable.pt2").module()(*x)
        out["portable_pt2"] = [float((p - ref).abs().max()), 0.0]
    loaded = sorted(m for m in ("fbgemm_gpu", "torchrec") if m in sys.modules)
    import onnxruntime as ort  # after the check: ONNX needs onnxruntime, not torch's stack
    sess = ort.InferenceSession(str(export / "model_portable.onnx"))
    p = torch.from_numpy(sess.run(None, {k: t.numpy() for k, t in zip(("dense", "values", "lengths"), x)})[0])
    out["portable_onnx"] = [float((p - ref).abs().max()), 0.0]
    print(json.dumps({"loaded": loaded, "rows": len(ref), "diff": out}))
    """
)


@pytest.mark.slow
def test_fresh_torch_only_process_reproduces_the_eager_probabilities(
    exported_portable: tuple[Path, Path, str],
) -> None:
    export, _, _ = exported_portable
    proc = subprocess.run(
        [sys.executable, "-c", FRESH, str(export)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["loaded"] == [] and got["rows"] == 1000
    for name in ("portable", "portable_pt2", "portable_onnx"):
        assert got["diff"][name][0] <= 1e-5, name
    assert got["diff"]["portable_fp16"][1] <= 1e-3
    assert 0 < got["diff"]["portable_fp16"][0] < 0.05  # really fp16: not bit-equal, still close


def test_the_fastest_cpu_variant_is_a_pt_file_that_passed_parity() -> None:
    from training.export.pipeline import fastest_cpu

    def lat(ms: float) -> dict[str, dict[str, float]]:
        return {"100": {"p50_ms": ms, "p99_ms": ms}}

    files = {v: Path(f"mapped_{v}.pt") for v in ("fp32", "int8")}
    files |= {v: Path(f"model_{v}.pt") for v in ("portable", "portable_fp16")}
    files["portable_onnx"] = Path("model_portable.onnx")
    latency = {"fp32": lat(3), "int8": lat(2), "portable": lat(1.5), "portable_fp16": lat(1),
               "portable_onnx": lat(0.5)}  # fmt: skip
    checks = [{"variant": v, "ok": v != "portable_fp16"} for v in files]
    assert fastest_cpu(latency, files, {"checks": checks}) == "portable"  # not ONNX, not failed
    assert fastest_cpu({}, files, {"checks": checks}) is None
    assert fastest_cpu(latency | {"portable": lat(2.5)}, files, {"checks": checks}) == "int8"
    # the CPU variant must be one the formats write
    message = "cpu_variant = portable: the formats written give fastest, fp16, fp32, int8"
    with pytest.raises(ConfigError, match=message):
        ExportConfig(run_dir=Path("x"), cpu_variant="portable").validate()
    ExportConfig(run_dir=Path("x"), formats=["int8", "portable"], cpu_variant="portable").validate()
    ExportConfig(run_dir=Path("x"), cpu_variant="fastest").validate()
