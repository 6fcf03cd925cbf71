"""Export: a 2-rank sharded checkpoint -> mapped int8/fp16/fp32 tables streamed in one process
(TorchScript and the other formats on request) -> .mar."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, run_export

pytestmark = pytest.mark.slow


def test_export_writes_variants_schema_parity_and_mar(exported: tuple[Path, Path, str]) -> None:
    export, store, report = exported
    schema = json.loads((export / "schema.json").read_text())
    parity = json.loads((export / "parity.json").read_text())
    assert parity["ok"] and parity["rows"] == 1000  # tiny's test split (half the held-out rows)
    assert parity["max_abs_diff"]["fp32"] <= 1e-6  # the streamed tables: the trained weights
    assert abs(parity["auc"]["int8"] - parity["auc"]["eager"]) <= 1e-3
    assert schema["features"]["sparse"][0] == "C1" and len(schema["features"]["dense"]) == 13
    assert schema["source"]["step"] == 40 and schema["source"]["world_size"] == 2
    assert schema["model"] == {"name": "dlrm-tiny", "version": "1.0", "arch": "dlrm"}
    # The trainer's own AUC on the same eval split, computed by the sharded model that trained
    # (metrics.jsonl, never read by the exporter): the exported models must match it. Shards
    # put back wrongly would still agree among eager, fp32 and int8, but not with the trainer.
    trainer = [json.loads(line) for line in (export.parent / "metrics.jsonl").open()]
    at_step = next(m for m in trainer if m["step"] == schema["source"]["step"])
    assert at_step["eval_rows"] == parity["rows"]
    for variant in ("eager", "fp32", "int8"):
        assert abs(parity["auc"][variant] - at_step["auc"]) <= 1e-3, (variant, at_step)
    assert schema["training_metrics"]["auc"] == at_step["auc"]
    # the rows it never trained on nor chose on (the tools' defaults): its test split, parity's
    unseen = schema["data"]["unseen"]
    assert (unseen["first_row"], unseen["rows"], unseen["at_end"]) == (19000, 1000, True)
    assert unseen["files"] == schema["data"]["files"] and "its test split" in unseen["why"]
    assert (schema["data"]["valid_rows"], schema["data"]["test_rows"]) == (1000, 1000)
    # its comparison with the linear baseline, for make export's and make serve's warning
    assert schema["quality"]["vs_baseline"] == schema["training_metrics"]["vs_baseline"]
    import hashlib

    for variant in ("fp32", "fp16", "int8"):
        info = schema["variants"][variant]
        assert info["kind"] == "mapped" and info["requires"] == ["torch"]
        for record in (info, info["tables"]):
            data = (export / record["file"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == record["sha256"]
            assert len(data) == record["bytes"]
    rows = sum(t["rows"] for t in schema["tables"])
    assert schema["variants"]["int8"]["tables"]["bytes"] == rows * (8 + 8)  # dim 8 + scale, bias
    assert schema["serving"]["cpu"] == "int8" and schema["serving"]["cuda"] == "fp16"
    mar = zipfile.ZipFile(store / "dlrm-tiny-1.0.mar")
    names = set(mar.namelist())
    assert {
        "mapped_int8.pt", "tables_int8.bin", "mapped_fp16.pt", "tables_fp16.bin", "schema.json",
        "handler.py", "codec.py", "mapped.py", "portable_model.py", "features.py",
        "deltas.py", "delta.py", "atomic.py", "MAR-INF/MANIFEST.json",
    } <= names  # fmt: skip
    assert "tables_fp32.bin" not in names  # the fp32 tables rebuild the model: not served
    for item in mar.infolist():  # weights stored as they are (one copy to archive or unpack)
        want = (
            zipfile.ZIP_STORED if item.filename.endswith((".bin", ".pt")) else zipfile.ZIP_DEFLATED
        )
        assert item.compress_type == want, item.filename
    manifest = json.loads(mar.read("MAR-INF/MANIFEST.json"))
    assert manifest["model"] == {
        "modelName": "dlrm-tiny", "serializedFile": "mapped_int8.pt", "handler": "handler.py",
        "modelVersion": "1.0",
    }  # fmt: skip
    assert "|ΔAUC| int8" in report
    # parity's cost: each model scored the rows once, printed; no latency loop unless asked
    assert set(parity["seconds"]) == {"eager", "fp32", "int8", "fp16"} and "latency" not in parity
    assert "parity: 1,000 held-out rows, each model once (eager " in report
    assert "latency not measured (--latency)" in report and "batch 512" not in report
    timings = json.loads((export / "timings.json").read_text())
    assert list(timings) == ["variants_s", "parity_s", "schema_s", "archive_s"]
    with np.load(export / "sample.npz") as sample:  # sliced from parity's scores, not redone
        assert sample["probs_int8"].shape == (1000,) and sample["labels"].shape == (1000,)


FRESH = textwrap.dedent(
    """
    import sys, numpy as np, torch
    from pathlib import Path
    from recsys_model.mapped import load_mapped
    m = load_mapped(Path(sys.argv[1]), torch.device("cpu"))
    s = np.load(sys.argv[2])
    d, v, l = (torch.from_numpy(s[k]) for k in ("dense", "values", "lengths"))
    with torch.inference_mode():
        p = m(d, v, l).numpy()
    loaded = [k for k in sys.modules if k.startswith(("torchrec", "fbgemm_gpu", "training"))]
    assert not loaded, loaded
    print(len(p), float(np.abs(p - s["probs_int8"]).max()))
    """
)


def test_fresh_process_with_torch_alone_scores_1000_rows(exported: tuple[Path, Path, str]) -> None:
    export, _, _ = exported
    proc = subprocess.run(
        [sys.executable, "-c", FRESH, str(export / "mapped_int8.pt"), str(export / "sample.npz")],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows, diff = proc.stdout.split()
    assert int(rows) == 1000 and float(diff) <= 1e-6


@pytest.mark.parametrize("variant", ["fp32", "int8"])
def test_batch_scores_equal_per_row_scores_at_any_batch_size(
    exported: tuple[Path, Path, str], variant: str
) -> None:
    from recsys_model.mapped import load_mapped

    export, _, _ = exported
    m = load_mapped(export / f"mapped_{variant}.pt", torch.device("cpu"))
    s = np.load(export / "sample.npz")
    dense, values, lengths = (torch.from_numpy(s[k]) for k in ("dense", "values", "lengths"))

    def rows(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Examples [lo, hi) of the feature-major batch (ids grouped by feature)."""
        by_feature = torch.split(values, lengths.sum(dim=1).tolist())
        pairs = zip(by_feature, lengths, strict=True)
        ids = [f[int(n[:lo].sum()) : int(n[:hi].sum())] for f, n in pairs]
        return dense[lo:hi], torch.cat(ids), lengths[:, lo:hi].contiguous()

    with torch.inference_mode():
        full = m(dense, values, lengths)
        assert torch.allclose(full, torch.from_numpy(s[f"probs_{variant}"]), atol=1e-6)
        for b in (1, 7, 1000):
            assert torch.allclose(m(*rows(0, b)), full[:b], atol=1e-6)
        one_by_one = torch.cat([m(*rows(i, i + 1)) for i in range(50)])
        assert torch.allclose(one_by_one, full[:50], atol=1e-6)


def _store_listing(store: Path) -> list[str]:
    return sorted(p.name for p in store.iterdir()) if store.exists() else []


def test_existing_version_is_not_overwritten(
    trained: Path, exported: tuple[Path, Path, str]
) -> None:
    _, store, _ = exported
    before = (store / "dlrm-tiny-1.0.mar").stat().st_mtime_ns
    proc = run_export(
        ["--run-dir", str(trained), "--model-store", str(store), "--version", "1.0"], check=False
    )
    assert proc.returncode == 2 and "exists: pick another --version" in proc.stderr
    assert (store / "dlrm-tiny-1.0.mar").stat().st_mtime_ns == before


def _copy_run(trained: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(trained, dst, ignore=shutil.ignore_patterns("export"))
    return dst


def _latest(run: Path) -> Path:
    return run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("metadata", "cannot read its DCP metadata"),
        ("missing", "has no complete checkpoint"),
        ("other_config", "belong to another model"),
        ("empty_eval", "no well-formed"),
    ],
)
def test_bad_inputs_fail_in_one_line_and_leave_nothing(
    trained: Path, tmp_path: Path, damage: str, message: str
) -> None:
    run = _copy_run(trained, tmp_path / "run")
    store = tmp_path / "store"
    extra: list[str] = []
    if damage == "metadata":
        (_latest(run) / ".metadata").write_bytes(b"\x00not a pickle")
    elif damage == "missing":
        for p in (run / "checkpoints").iterdir():
            if p.is_dir():
                import shutil

                shutil.rmtree(p)
        (run / "checkpoints" / "latest").unlink()
    elif damage == "other_config":
        meta_path = _latest(run) / "meta.json"
        meta = json.loads(meta_path.read_text())
        meta["config"]["model"]["embedding_dim"] = 16
        meta["config"]["model"]["dense_arch"] = [16, 16]
        meta_path.write_text(json.dumps(meta))
    elif damage == "empty_eval":
        empty = tmp_path / "empty.tsv"
        empty.write_text("")
        extra = ["--eval-data", str(empty)]
    proc = run_export(["--run-dir", str(run), "--model-store", str(store), *extra], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert _store_listing(store) == []  # nothing half-written in the model store
    assert not (run / "export").exists() and not list(run.glob(".export.tmp-*"))


def test_int8_artifact_is_over_3x_smaller_when_tables_dominate(tmp_path: Path) -> None:
    # Criteo-like shape where tables dominate (dim 16, 26 x 40k rows): int8 rows are 16 B +
    # 4 B scale/bias, unpadded on CPU, vs 64 B in fp32. (The criteo-kaggle preset itself:
    # 2062.7 MiB -> 645.9 MiB, 3.19x, measured by hand; too large for CI.)
    from training.config import load_config
    from training.export.scorer import script_variant
    from training.model import build_dlrm

    cfg = load_config(
        "training/configs/tiny.toml",
        ["model.embedding_dim=16", "model.num_embeddings=40000", "model.dense_arch=[32,16]"],
    )
    dlrm = build_dlrm(cfg.model, device="cpu").eval()
    sizes = {}
    for variant in ("fp32", "int8"):
        path = tmp_path / f"{variant}.pt"
        script_variant(dlrm, cfg, variant).save(str(path))  # type: ignore[arg-type]
        sizes[variant] = path.stat().st_size
    assert sizes["fp32"] / sizes["int8"] >= 3.0, sizes


def _trainer_auc(run: Path, step: int) -> float:
    """The trainer's own eval AUC at ``step`` (metrics.jsonl), independent of the exporter."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").open()]
    return float(next(m["auc"] for m in rows if m["step"] == step))


@pytest.mark.parametrize(
    ("formats", "cpu", "served_file"),
    [('["fp32"]', "fp32", "mapped_fp32.pt"), ('["torchscript"]', "ts_int8", "model_int8.pt")],
)
def test_formats_on_request_export_and_serve_that_variant(
    trained: Path, tmp_path: Path, formats: str, cpu: str, served_file: str
) -> None:
    """Only the formats asked for (plus the fp32 tables, the parity reference), and the CPU
    variant named is what the .mar serves; TorchRec's TorchScript files are still a format."""
    run, store = _copy_run(trained, tmp_path / "run"), tmp_path / "store"
    args = ["--formats", formats, "--cpu-variant", cpu]
    run_export(["--run-dir", str(run), "--model-store", str(store), *args])
    export = run / "export"
    schema = json.loads((export / "schema.json").read_text())
    parity = json.loads((export / "parity.json").read_text())
    want = {"fp32"} | ({"ts_fp32", "ts_int8"} if cpu == "ts_int8" else set())
    assert set(schema["variants"]) == want and not (export / "tables_int8.bin").exists()
    assert parity["ok"] and abs(parity["auc"][cpu] - parity["auc"]["eager"]) <= 1e-3
    assert abs(parity["auc"][cpu] - _trainer_auc(run, schema["source"]["step"])) <= 1e-3
    (mar,) = store.glob("*.mar")
    manifest = json.loads(zipfile.ZipFile(mar).read("MAR-INF/MANIFEST.json"))
    assert manifest["model"]["serializedFile"] == served_file
    from serving.worker.scoring import load_artifact

    m = load_artifact(export / served_file, schema["variants"][cpu], torch.device("cpu"), None)
    s = np.load(export / "sample.npz")
    with torch.inference_mode():
        p = m(*(torch.from_numpy(s[k]) for k in ("dense", "values", "lengths"))).numpy()
    np.testing.assert_allclose(p, s[f"probs_{cpu}"], atol=1e-6, rtol=0)


def test_a_corrupt_table_fails_parity_and_exports_nothing_unless_forced(
    trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A broken export: the int8 writer puts C1's rows in reverse order (an offset bug), the
    other formats are right. Parity, each model scoring the rows once, must refuse it."""
    from recsys_model.table_writer import TableWriter
    from training.export.__main__ import main

    write = TableWriter.write

    def reversed_first_table(self: TableWriter, start: int, rows: torch.Tensor) -> None:
        write(self, start, rows.flip(0) if self.fmt == "int8" and start == 0 else rows)

    monkeypatch.setattr(TableWriter, "write", reversed_first_table)
    run, store = _copy_run(trained, tmp_path / "run"), tmp_path / "store"
    args = ["--no-progress", "--run-dir", str(run), "--model-store", str(store)]
    assert main(args) == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
    print(errors)
    assert len(errors) == 1 and "parity failed on 1000 rows" in errors[0], errors
    assert "|ΔAUC| int8 vs eager" in errors[0] and "(--force exports anyway)" in errors[0]
    assert "fp16" not in errors[0]  # the formats written right pass
    assert _store_listing(store) == [] and not (run / "export").exists()
    assert main([*args, "--force"]) == 0
    report = json.loads((run / "export" / "parity.json").read_text())
    schema = json.loads((run / "export" / "schema.json").read_text())
    assert report["forced"] is True and report["ok"] is False
    assert schema["parity"]["forced"] is True and schema["parity"]["ok"] is False
    assert [p.suffix for p in store.iterdir()] == [".mar"]


def test_variants_this_machine_does_not_serve_are_checked_on_a_sample(
    trained: Path, tmp_path: Path
) -> None:
    """Issue 46 item 3: the fp16 tables (CUDA workers') scored all 20,000 parity rows on the
    CPU, 391 s of a 488 s first demo export. Without CUDA they are checked on the first
    ``unserved_parity_rows``, against the reference on the same rows; the served int8 on all."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine serves fp16: it is checked on every row there")
    run = _copy_run(trained, tmp_path / "run")
    proc = run_export(["--run-dir", str(run), "--model-store", str(tmp_path / "store"),
                       "--version", "1.0", "--unserved-parity-rows", "300"])  # fmt: skip
    # the report says which rows each AUC is on (fp16's looked like another model's)
    assert "parity: 1,000 held-out rows (fp16 300), each model once" in proc.stdout
    (fp16,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("fp16 ")]
    assert fp16.endswith("(on its first 300 rows: not served here)"), fp16
    parity = json.loads((run / "export" / "parity.json").read_text())
    assert parity["rows"] == 1000 and parity["ok"]
    assert parity["rows_by_variant"]["fp16"] == 300, parity["rows_by_variant"]
    assert parity["rows_by_variant"]["int8"] == 1000
    assert abs(parity["auc"]["fp16"] - parity["auc"]["eager"]) < 0.05  # on 300 rows vs 1,000


def test_ctrl_c_ends_an_export_at_once_in_one_line_and_leaves_nothing(
    trained: Path, tmp_path: Path
) -> None:
    """Issue 46 item 5: Ctrl-C on `make export` printed a 10-frame KeyboardInterrupt traceback
    and took ~60 s to take effect. Now: one line, exit 130 within seconds, no temporary folder
    left in the run or the model store, nothing exported."""
    import signal
    import time

    run, store = _copy_run(trained, tmp_path / "run"), tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-m", "training.export", "--run-dir", str(run), "--model-store",
         str(store), "--version", "1.0", "--latency", "--no-progress"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not list(run.glob(".export.tmp-*")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        assert list(run.glob(".export.tmp-*")), "the export never started its work"
        time.sleep(0.5)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    print(err[-2000:], f"took {took:.2f} s")
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        "interrupted (Ctrl-C)"
    )
    assert took < 10, took
    assert not list(run.glob(".export*")) and not (run / "export").exists()
    assert not store.exists() or not list(store.iterdir())
