"""Serving the portable variant: the handler's device/dtype choice, torch-only loading, a real
TorchServe serving it on CPU when configured, and the device check (``serving.tools.gpu_check``)."""

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
SCHEMA = {
    "variants": {
        "int8": {"file": "model_int8.pt", "kind": "torchscript"},
        "portable": {"file": "model_portable.pt", "kind": "torchscript"},
        "portable_fp16": {"file": "model_portable_fp16.pt", "kind": "torchscript"},
        "portable_onnx": {"file": "model_portable.onnx", "kind": "onnx"},
    },
    "serving": {"cpu": "int8", "cuda": "portable", "cuda_dtype": "fp16"},
}


def test_cpu_serves_the_archived_file_and_cuda_the_portable_scorer() -> None:
    assert choose_variant(SCHEMA, "model_int8.pt", CPU, {}) == ("int8", "model_int8.pt", None)
    fp16 = ("portable_fp16", "model_portable_fp16.pt", None)
    assert choose_variant(SCHEMA, "model_int8.pt", CUDA, {}) == fp16
    env = {"RECSYS_CUDA_DTYPE": "bf16"}
    bf16 = ("portable", "model_portable.pt", torch.bfloat16)
    assert choose_variant(SCHEMA, "model_int8.pt", CUDA, env) == bf16
    fp32 = ("portable", "model_portable.pt", None)
    assert choose_variant(SCHEMA, "model_int8.pt", CUDA, {"RECSYS_CUDA_DTYPE": "fp32"}) == fp32
    bf16_schema = {**SCHEMA, "serving": {**SCHEMA["serving"], "cuda_dtype": "bf16"}}
    assert choose_variant(bf16_schema, "model_int8.pt", CUDA, {}) == bf16


def test_a_named_variant_wins_and_bad_names_are_refused() -> None:
    env = {"RECSYS_VARIANT": "portable"}
    assert choose_variant(SCHEMA, "model_int8.pt", CPU, env)[:2] == (
        "portable",
        "model_portable.pt",
    )
    with pytest.raises(ValueError, match=r"RECSYS_VARIANT=portabel: this export serves int8, "):
        choose_variant(SCHEMA, "model_int8.pt", CPU, {"RECSYS_VARIANT": "portabel"})
    with pytest.raises(ValueError, match="RECSYS_VARIANT=portable_onnx"):  # not for torch
        choose_variant(SCHEMA, "model_int8.pt", CPU, {"RECSYS_VARIANT": "portable_onnx"})
    with pytest.raises(ValueError, match=r"RECSYS_CUDA_DTYPE=fp8: use one of fp32, fp16, bf16"):
        choose_variant(SCHEMA, "model_int8.pt", CUDA, {"RECSYS_CUDA_DTYPE": "fp8"})


def test_an_export_without_portable_variants_serves_its_file_everywhere() -> None:
    old = {"variants": {"int8": {"file": "model_int8.pt"}}}  # schema of an older export
    for device in (CPU, CUDA):
        assert choose_variant(old, "model_int8.pt", device, {}) == ("int8", "model_int8.pt", None)


LOAD = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from serving.worker.scoring import ScoringModel
    m = ScoringModel(Path(sys.argv[1]), "model_portable_fp16.pt", torch.device("cpu"))
    print(sorted(k for k in ("fbgemm_gpu", "torchrec", "codec") if k in sys.modules), m.variant["requires"])
    """
)


@pytest.mark.slow
def test_scoring_model_loads_a_portable_variant_without_fbgemm(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    export, _, _ = exported
    proc = subprocess.run(
        [sys.executable, "-c", LOAD, str(export)], capture_output=True, text=True, cwd=ROOT,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[0] == "[] ['torch']"
    s = np.load(export / "sample.npz")
    x = tuple(torch.from_numpy(s[k]) for k in ("dense", "values", "lengths"))
    model = ScoringModel(export, "model_portable.pt", CPU)
    (probs,) = model.forward([x])
    np.testing.assert_allclose(probs.numpy(), s["probs_eager"], atol=1e-6)
    with pytest.raises(ValueError, match="only a portable variant can be cast"):
        ScoringModel(export, "model_int8.pt", CPU, torch.bfloat16)
    (tmp_path / "schema.json").write_text(
        json.dumps(SCHEMA | {"features": {"dense": [], "sparse": []}})
    )
    (tmp_path / "model_int8.pt").touch()
    with pytest.raises(
        ValueError, match=r"model_portable.pt is not in .* \(it has model_int8.pt\)"
    ):
        ScoringModel(tmp_path, "model_portable.pt", CPU)


@pytest.mark.slow
def test_torchserve_serves_the_portable_variant_when_configured(
    exported: tuple[Path, Path, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    export, store, _ = exported
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


@pytest.mark.slow
def test_make_gpu_check_runs_its_cpu_half_with_torch_alone(
    exported: tuple[Path, Path, str], tmp_path: Path
) -> None:
    export, _, _ = exported
    # numpy, fbgemm and torchrec made unimportable in the checker's interpreter from its start
    (tmp_path / "sitecustomize.py").write_text(
        "import pathlib, sys\nfor m in ('numpy', 'fbgemm_gpu', 'torchrec'):\n"
        "    sys.modules[m] = None\n"
        f"pathlib.Path({str(tmp_path / 'blocked')!r}).touch()\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    args = "--iters 3 --batches '[1, 64, 512]'"
    proc = subprocess.run(
        ["make", "--no-print-directory", "gpu-check", f"RUN={export.parent}",
         f"GPU_CHECK_ARGS={args}"],
        capture_output=True, text=True, cwd=ROOT, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "CUDA is not available here: running the CPU half only" in out
    assert (tmp_path / "blocked").exists()  # the checker ran with the three blocked
    for name in ("portable", "portable_fp16", "portable_pt2", "rebuilt"):
        assert f"ok   cpu {name} " in out, name
    assert "batch 512" in out and out.rstrip().endswith("gpu-check: ok")


def test_exports_from_before_variant_requirements_still_load_fbgemm() -> None:
    """A schema written before variants recorded "requires" names TorchRec files only: they
    need fbgemm (an export of the previous release would not load otherwise)."""
    from serving.worker.scoring import variant_of

    old = {"variants": {"int8": {"file": "model_int8.pt", "bytes": 1, "sha256": "x"}}}
    assert "fbgemm_gpu" in variant_of(old, "model_int8.pt")["requires"]
    assert "fbgemm_gpu" in variant_of({}, "model_fp32.pt")["requires"]
    new = {"variants": {"portable": {"file": "p.pt", "kind": "torchscript", "requires": ["torch"]}}}
    assert variant_of(new, "p.pt")["requires"] == ["torch"]
