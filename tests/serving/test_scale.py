"""Scale I against a real TorchServe: a replica's workers map one copy of the tables (PSS),
and an archive whose tables are damaged is refused at registration with the file named, while
the version already serving keeps serving.

The model: the tiny preset with 26 tables of 100k rows (int8 tables: 41.6 MB), big enough that
the tables, not the worker, show in the memory figures. Full-size figures: ``make bench-scale``.
"""

from __future__ import annotations

import json
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest

from serving.torchserve import manage
from serving.torchserve.client import score
from serving.torchserve.config import TorchServeConfig
from serving.torchserve.keys import inference_key
from serving.worker.codec import decode_response, encode_request
from serving.worker.scoring import slice_examples
from tests.conftest import EXPORT_TINY, run_export, run_train
from tests.stack import running_torchserve

pytestmark = pytest.mark.slow
ROWS = 100_000
MODEL = {"mar_file": "dlrm-big-1.0.mar", "model_name": "dlrm-big", "model_version": "1.0"}


@pytest.fixture(scope="module")
def big_export(tmp_path_factory: pytest.TempPathFactory, data_dirs: list[str]) -> tuple[Path, Path]:
    """(export folder, model store) of the tiny preset with 100k-row tables."""
    run = tmp_path_factory.mktemp("big_run")
    store = tmp_path_factory.mktemp("big_store")
    run_train(
        [*EXPORT_TINY, "--run-dir", str(run), *data_dirs, f"model.num_embeddings={ROWS}",
         "train.max_steps=20"], nproc=0,
    )  # fmt: skip
    run_export(["--run-dir", str(run), "--model-store", str(store), "--name", "dlrm-big",
                "--version", "1.0"])  # fmt: skip
    return run / "export", store


def mapping(pid: int, name: str) -> tuple[int, int]:
    """(Rss, Pss) bytes of ``pid``'s mappings of files called ``name`` (/proc/<pid>/smaps)."""
    rss = pss = 0
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and "-" in fields[0] and ":" in fields[3]:  # a mapping's header
            inside = len(fields) >= 6 and fields[-1].endswith("/" + name)
        elif inside and fields[0] == "Rss:":
            rss += int(fields[1]) * 1024
        elif inside and fields[0] == "Pss:":
            pss += int(fields[1]) * 1024
    return rss, pss


def workers(torchserve: psutil.Process) -> list[psutil.Process]:
    return [
        p for p in torchserve.children(recursive=True)
        if any("model_service_worker" in a for a in p.cmdline())
    ]  # fmt: skip


@pytest.fixture(scope="module")
def replica(
    big_export: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TorchServeConfig]:
    """Two workers of one replica, every table page read in at load (RECSYS_PRELOAD_TABLES)."""
    _, store = big_export
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RECSYS_PRELOAD_TABLES", "1")
        with running_torchserve(store, tmp_path_factory.mktemp("ts"), workers=2, **MODEL) as (
            cfg,
            _proc,
        ):
            yield cfg


def test_two_workers_share_one_copy_of_the_tables(
    big_export: tuple[Path, Path], replica: TorchServeConfig
) -> None:
    export, _ = big_export
    schema = json.loads((export / "schema.json").read_text())
    size = schema["variants"]["int8"]["tables"]["bytes"]
    assert size == 26 * ROWS * (8 + 8)
    ts = next(p for p in psutil.process_iter(["cmdline"]) if str(replica.workdir) in " ".join(
        p.info["cmdline"] or []) and "java" in (p.info["cmdline"] or [""])[0])  # fmt: skip
    # the fixture returns once one worker is READY: wait (generously) for both to map it all
    deadline = time.monotonic() + 180
    while True:
        found = [mapping(w.pid, "tables_int8.bin") for w in workers(ts)]
        if len(found) == 2 and all(rss >= 0.95 * size for rss, _ in found):
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    print(f"tables {size >> 20} MiB; per worker (Rss, Pss) MiB: "
          f"{[(r >> 20, p >> 20) for r, p in found]}")  # fmt: skip
    assert len(found) == 2
    for rss, _ in found:
        assert rss >= 0.95 * size  # each worker has all of it mapped in...
    assert sum(pss for _, pss in found) <= 1.05 * size  # ...and the two share one copy


def test_the_replica_scores_like_the_export(
    big_export: tuple[Path, Path], replica: TorchServeConfig
) -> None:
    export, _ = big_export
    s = dict(np.load(export / "sample.npz"))
    np.testing.assert_allclose(scores(replica, s, 64), s["probs_int8"][:64], atol=1e-6)


def scores(cfg: TorchServeConfig, sample: dict[str, np.ndarray], n: int) -> np.ndarray:
    """The replica's scores of the sample's first ``n`` rows (TorchServe's gRPC API)."""
    import torch

    x = tuple(torch.from_numpy(sample[k]) for k in ("dense", "values", "lengths"))
    with grpc.insecure_channel(cfg.grpc_inference_target) as channel:
        body = encode_request(*slice_examples(*x, 0, n))
        model = (cfg.model_name, cfg.model_version)
        return decode_response(score(channel, model, body, 30, inference_key(cfg.key_file)))


def damaged_archive(good: Path, out: Path, version: str) -> None:
    """``good`` with its int8 tables' bytes changed (same size) and another version."""
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(out, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "tables_int8.bin":
                data = data[:100] + bytes(b ^ 0xFF for b in data[100:116]) + data[116:]
            elif item.filename == "MAR-INF/MANIFEST.json":
                doc = json.loads(data)
                doc["model"]["modelVersion"] = version
                data = json.dumps(doc).encode()
            dst.writestr(item, data, compress_type=item.compress_type)


def test_damaged_tables_are_refused_at_registration_and_the_served_version_stays(
    big_export: tuple[Path, Path], replica: TorchServeConfig
) -> None:
    export, store = big_export
    damaged_archive(store / MODEL["mar_file"], store / "dlrm-big-2.0.mar", "2.0")
    with pytest.raises(manage.ManageError) as refused:
        manage.register(replica, "dlrm-big", "2.0", "dlrm-big-2.0.mar", timeout=120)
    print("registration refused:", refused.value)
    log = replica.log_file.read_text(errors="replace")  # the workers' lines: TorchServe's stdout
    assert "tables_int8.bin: checksum differs from the export's" in log
    assert "2.0" not in manage.versions(replica, "dlrm-big")
    s = dict(np.load(export / "sample.npz"))
    np.testing.assert_allclose(scores(replica, s, 8), s["probs_int8"][:8], atol=1e-6)
