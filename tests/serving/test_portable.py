"""What each device serves: the handler's device/dtype choice (the default export's mapped int8
tables on CPU and fp16 tables on CUDA; the portable TorchScript pair of an export asked for with
``--formats``), torch-only loading, a real TorchServe serving the portable variant on CPU when
configured, and the device check (``serving.tools.gpu_check``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from serving.torchserve.client import score
from serving.torchserve.keys import inference_key
from serving.worker.codec import decode_response, encode_request
from serving.worker.scoring import ScoringModel, choose_variant, slice_examples
from tests.stack import running_torchserve

ROOT = Path(__file__).resolve().parents[2]
CPU, CUDA = torch.device("cpu"), torch.device("cuda:1")
MAPPED = {"kind": "mapped", "requires": ["torch"]}
# the default export's variants (--formats '["int8", "fp16", "fp32"]')
SCHEMA = {
    "variants": {
        "int8": {"file": "mapped_int8.pt", **MAPPED, "device": "cpu"},
        "fp16": {"file": "mapped_fp16.pt", **MAPPED, "device": "any"},
        "fp32": {"file": "mapped_fp32.pt", **MAPPED, "device": "any"},
    },
    "serving": {"cpu": "int8", "cuda": "fp16", "cuda_dtype": "fp16"},
}
# an export asked for --formats '["int8", "fp32", "portable", "onnx"]': no fp16 tables, so CUDA
# workers load the portable TorchScript pair
PORTABLE = {
    "variants": {
        "int8": SCHEMA["variants"]["int8"],
        "fp32": SCHEMA["variants"]["fp32"],
        "portable": {"file": "model_portable.pt", "kind": "torchscript"},
        "portable_fp16": {"file": "model_portable_fp16.pt", "kind": "torchscript"},
        "portable_onnx": {"file": "model_portable.onnx", "kind": "onnx"},
    },
    "serving": {"cpu": "int8", "cuda": "portable", "cuda_dtype": "fp16"},
}


def test_cpu_serves_the_archived_file_and_cuda_the_fp16_tables() -> None:
    assert choose_variant(SCHEMA, "mapped_int8.pt", CPU, {}) == ("int8", "mapped_int8.pt", None)
    fp16 = ("fp16", "mapped_fp16.pt", None)
    assert choose_variant(SCHEMA, "mapped_int8.pt", CUDA, {}) == fp16
    bf16 = ("fp16", "mapped_fp16.pt", torch.bfloat16)  # cast from the fp16 tables at load
    assert choose_variant(SCHEMA, "mapped_int8.pt", CUDA, {"RECSYS_CUDA_DTYPE": "bf16"}) == bf16
    bf16_schema = {**SCHEMA, "serving": {**SCHEMA["serving"], "cuda_dtype": "bf16"}}
    assert choose_variant(bf16_schema, "mapped_int8.pt", CUDA, {}) == bf16
    # the fp32 tables are not archived: a CUDA worker asked for fp32 still loads fp16's file
    assert choose_variant(SCHEMA, "mapped_int8.pt", CUDA, {"RECSYS_CUDA_DTYPE": "fp32"}) == fp16


def test_cuda_serves_the_portable_scorer_of_an_export_without_fp16_tables() -> None:
    assert choose_variant(PORTABLE, "mapped_int8.pt", CPU, {})[:2] == ("int8", "mapped_int8.pt")
    fp16 = ("portable_fp16", "model_portable_fp16.pt", None)
    assert choose_variant(PORTABLE, "mapped_int8.pt", CUDA, {}) == fp16
    env = {"RECSYS_CUDA_DTYPE": "bf16"}
    bf16 = ("portable", "model_portable.pt", torch.bfloat16)
    assert choose_variant(PORTABLE, "mapped_int8.pt", CUDA, env) == bf16
    fp32 = ("portable", "model_portable.pt", None)
    assert choose_variant(PORTABLE, "mapped_int8.pt", CUDA, {"RECSYS_CUDA_DTYPE": "fp32"}) == fp32
    bf16_schema = {**PORTABLE, "serving": {**PORTABLE["serving"], "cuda_dtype": "bf16"}}
    assert choose_variant(bf16_schema, "mapped_int8.pt", CUDA, {}) == bf16


def test_a_named_variant_wins_and_bad_names_are_refused() -> None:
    env = {"RECSYS_VARIANT": "portable"}
    assert choose_variant(PORTABLE, "mapped_int8.pt", CPU, env)[:2] == (
        "portable",
        "model_portable.pt",
    )
    env = {"RECSYS_VARIANT": "fp32"}
    assert choose_variant(SCHEMA, "mapped_int8.pt", CUDA, env)[:2] == ("fp32", "mapped_fp32.pt")
    with pytest.raises(ValueError, match=r"RECSYS_VARIANT=portabel: this export serves int8, "):
        choose_variant(PORTABLE, "mapped_int8.pt", CPU, {"RECSYS_VARIANT": "portabel"})
    with pytest.raises(ValueError, match="RECSYS_VARIANT=portable_onnx"):  # not for torch
        choose_variant(PORTABLE, "mapped_int8.pt", CPU, {"RECSYS_VARIANT": "portable_onnx"})
    with pytest.raises(ValueError, match=r"RECSYS_CUDA_DTYPE=fp8: use one of fp32, fp16, bf16"):
        choose_variant(SCHEMA, "mapped_int8.pt", CUDA, {"RECSYS_CUDA_DTYPE": "fp8"})


def test_an_export_without_a_cuda_variant_serves_its_file_everywhere() -> None:
    old = {"variants": {"int8": {"file": "model_int8.pt"}}}  # schema of an older export
    for device in (CPU, CUDA):
        assert choose_variant(old, "model_int8.pt", device, {}) == ("int8", "model_int8.pt", None)
    # TorchRec's TorchScript only (--formats '["torchscript"]'): CPU files, no CUDA choice
    ts = {
        "variants": {"ts_int8": {"file": "model_int8.pt", "kind": "torchscript"}},
        "serving": {"cpu": "ts_int8", "cuda": None},
    }
    for device in (CPU, CUDA):
        assert choose_variant(ts, "model_int8.pt", device, {}) == ("ts_int8", "model_int8.pt", None)


LOAD = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from serving.worker.scoring import ScoringModel
    for file in ("model_portable_fp16.pt", "mapped_int8.pt"):
        m = ScoringModel(Path(sys.argv[1]), file, torch.device("cpu"))
        print(sorted(k for k in ("fbgemm_gpu", "torchrec", "codec") if k in sys.modules), m.variant["requires"])
    """
)


@pytest.mark.slow
def test_scoring_model_loads_portable_and_mapped_variants_without_fbgemm(
    exported_portable: tuple[Path, Path, str], tmp_path: Path
) -> None:
    export, _, _ = exported_portable
    proc = subprocess.run(
        [sys.executable, "-c", LOAD, str(export)], capture_output=True, text=True, cwd=ROOT,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:2] == ["[] ['torch']"] * 2
    s = np.load(export / "sample.npz")
    x = tuple(torch.from_numpy(s[k]) for k in ("dense", "values", "lengths"))
    model = ScoringModel(export, "model_portable.pt", CPU)
    probs = model.forward(x)
    np.testing.assert_allclose(probs.numpy(), s["probs_eager"], atol=1e-6)
    with pytest.raises(ValueError, match="on CPU a mapped variant is served in its own dtype"):
        ScoringModel(export, "mapped_int8.pt", CPU, torch.bfloat16)
    (tmp_path / "schema.json").write_text(
        json.dumps(PORTABLE | {"features": {"dense": [], "sparse": []}})
    )
    (tmp_path / "mapped_int8.pt").touch()
    with pytest.raises(
        ValueError, match=r"model_portable.pt is not in .* \(it has mapped_int8.pt\)"
    ):
        ScoringModel(tmp_path, "model_portable.pt", CPU)


@pytest.mark.slow
def test_torchserve_serves_the_portable_variant_when_configured(
    exported_portable: tuple[Path, Path, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An export asked for the portable format (``--formats``) carries its TorchScript pair in
    the .mar beside the int8 tables; ``RECSYS_VARIANT`` makes a CPU worker serve it."""
    export, store, _ = exported_portable
    s = np.load(export / "sample.npz")
    x = tuple(torch.from_numpy(s[k]) for k in ("dense", "values", "lengths"))
    # the int8 file differs from eager: scores equal to the portable's show which one served
    assert np.abs(s["probs_int8"] - s["probs_portable"]).max() > 1e-5
    monkeypatch.setenv("RECSYS_VARIANT", "portable")  # TorchServe's workers inherit it
    with running_torchserve(store, tmp_path / "ts", workers=1) as (cfg, _):
        with grpc.insecure_channel(cfg.grpc_inference_target) as channel:
            model = (cfg.model_name, cfg.model_version)
            key = inference_key(cfg.key_file)
            for lo, hi in ((0, 1), (1, 200)):
                body = encode_request(*slice_examples(*x, lo, hi))
                got = decode_response(score(channel, model, body, 30, key))
                np.testing.assert_allclose(got, s["probs_portable"][lo:hi], atol=1e-6)
        log = cfg.log_file.read_text(errors="replace")  # the worker's lines: TorchServe's stdout
        assert "variant portable (model_portable.pt) on cpu" in log


def _gpu_check(run: Path, tmp_path: Path) -> str:
    """``make gpu-check RUN=run`` with numpy, fbgemm and torchrec unimportable and no CUDA: its
    stdout (it must exit 0)."""
    # numpy, fbgemm and torchrec made unimportable in the checker's interpreter from its start
    (tmp_path / "sitecustomize.py").write_text(
        "import pathlib, sys\nfor m in ('numpy', 'fbgemm_gpu', 'torchrec'):\n"
        "    sys.modules[m] = None\n"
        f"pathlib.Path({str(tmp_path / 'blocked')!r}).touch()\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    args = "--iters 3 --batches '[1, 64, 512]'"
    proc = subprocess.run(
        ["make", "--no-print-directory", "gpu-check", f"RUN={run}", f"GPU_CHECK_ARGS={args}"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "CUDA is not available here: running the CPU half only" in out
    assert (tmp_path / "blocked").exists()  # the checker ran with the three blocked
    assert "batch 512" in out and out.rstrip().endswith("gpu-check: ok")
    return out


@pytest.mark.slow
def test_make_gpu_check_runs_its_cpu_half_of_the_default_export_with_torch_alone(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    """The mapped fp16 tables (what CUDA workers load) against the export's probabilities, and
    the handler's stages (CPU: the int8 tables); the fp32 tables, not archived, left behind in
    a copy of the folder are skipped with a note."""
    import shutil

    export, _, _ = exported
    copy = tmp_path / "run" / "export"
    shutil.copytree(export, copy, ignore=shutil.ignore_patterns("tables_fp32.bin", ".verified-*"))
    out = _gpu_check(copy.parent, tmp_path)
    assert "reference: the export's probs_eager (1000 rows)" in out
    assert "ok   cpu fp16 " in out and "|ΔAUC| vs eager" in out
    assert f"skip cpu fp32: tables_fp32.bin not in {copy}" in out
    assert "handler stages on cpu: int8 (mapped_int8.pt) |ΔAUC| vs eager" in out
    assert "portable" not in out and "rebuilt" not in out  # not in the default export


@pytest.mark.slow
def test_make_gpu_check_runs_its_cpu_half_of_the_portable_formats_with_torch_alone(
    exported_portable: tuple[Path, Path, str], tmp_path: Path
) -> None:
    export, _, _ = exported_portable
    out = _gpu_check(export.parent, tmp_path)
    for name in ("fp32", "portable", "portable_fp16", "portable_pt2", "rebuilt"):
        assert f"ok   cpu {name} " in out, name
    assert "ok   cpu fp32            max |Δp| vs eager" in out
    assert "handler stages on cpu: int8 (mapped_int8.pt)" in out


def test_gpu_check_refuses_an_export_without_a_gpu_variant(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from serving.tools.gpu_check import main

    ts = {"variants": {"ts_int8": {"file": "model_int8.pt", "requires": ["torch", "fbgemm_gpu"],
                                   "device": "cpu"}}}  # fmt: skip
    (tmp_path / "schema.json").write_text(json.dumps(ts))
    assert main(["--export", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "has no variant torch loads on a GPU" in err and "default formats" in err
    (tmp_path / "schema.json").write_text(json.dumps(SCHEMA))
    assert main(["--export", str(tmp_path), "--aoti"]) == 2
    assert "--aoti compiles the pt2 program" in capsys.readouterr().err


def test_exports_from_before_variant_requirements_still_load_fbgemm() -> None:
    """A schema written before variants recorded "requires" names TorchRec files only: they
    need fbgemm (an export of the previous release would not load otherwise)."""
    from serving.worker.scoring import variant_of

    old = {"variants": {"int8": {"file": "model_int8.pt", "bytes": 1, "sha256": "x"}}}
    assert "fbgemm_gpu" in variant_of(old, "model_int8.pt")["requires"]
    assert "fbgemm_gpu" in variant_of({}, "model_fp32.pt")["requires"]
    new = {"variants": {"portable": {"file": "p.pt", "kind": "torchscript", "requires": ["torch"]}}}
    assert variant_of(new, "p.pt")["requires"] == ["torch"]
