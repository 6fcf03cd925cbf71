"""Embedding deltas (issue 36): a checkpoint's changed rows over the served export, applied by a
worker's chain, equal to a full export of the same checkpoint; refused whole when bad; swapped
whole (a batch never mixes two versions); rolled back without I/O.

One module fixture: a copy of the session's tiny run trained 10 steps further (one process,
warm), a full export of that checkpoint, and the delta of it over the session's export."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from recsys_model.delta import read_pointer, write_pointer
from recsys_model.mapped import load_mapped
from serving.bench.servers import wait_all_workers
from serving.tools.deltas import wait_served
from serving.tools.served import RolloutError
from serving.torchserve import process
from serving.torchserve.client import inference_key, score
from serving.worker.codec import decode_response, encode_request
from serving.worker.deltas import APPLY_DELAY_ENV, Deltas
from tests.conftest import run_export, run_train
from tests.stack import STARTUP_TIMEOUT_S, torchserve_config
from training.checkpoint import store as checkpoint
from training.checkpoint.rows import TableRows, table_rows
from training.config import config_from_dict
from training.export.delta import differing_rows, make_delta
from training.export.portable import EBC
from training.export.scorer import CHECKPOINT_PREFIX
from training.features import SPARSE_NAMES, table_name


@pytest.fixture(scope="module")
def later(
    trained: Path, exported: tuple[Path, Path, str], data_dirs: list[str],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Any]:  # fmt: skip
    base = tmp_path_factory.mktemp("delta")
    run = base / "run"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns("export", ".export*"))
    run_train(["--config", "training/configs/tiny.toml", "--no-progress", "--run-dir", str(run),
               "train.max_steps=50", *data_dirs], nproc=0)  # fmt: skip
    ckpt = checkpoint.read_latest(run / "checkpoints")
    assert ckpt is not None and ckpt.name.endswith("50"), ckpt
    run_export(["--run-dir", str(run), "--model-store", str(base / "store"), "--version", "2"])
    cfg = config_from_dict(checkpoint.read_meta(ckpt)["config"])
    folder = base / "deltas" / "dlrm-tiny" / "1.0"
    record, _, _ = make_delta(ckpt, cfg.model, exported[0], folder, "50")
    return {"folder": folder, "record": record, "full": run / "export", "base": exported[0]}


def _batch(model: Any, seed: int = 0, batch: int = 256) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    features = len(model.spec["rows"])
    return (torch.randn(batch, int(model.spec["num_dense"]), generator=g),
            torch.randint(0, 10**7, (features * batch,), generator=g),
            torch.ones(features, batch, dtype=torch.int32))  # fmt: skip


def _worker(base_dir: Path, folder: Path) -> Deltas:
    base = load_mapped(base_dir / "mapped_int8.pt", torch.device("cpu"))
    sha = torch.load(base_dir / "mapped_int8.pt", weights_only=True)["tables"]["sha256"]
    return Deltas(folder, base, "1.0", sha)


def _score(model: Any, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    with torch.inference_mode():
        return model(*batch)


def test_delta_scores_as_a_full_export_and_is_small(later: dict[str, Any], tmp_path: Path) -> None:
    folder, record = tmp_path / "1.0", later["record"]
    shutil.copytree(later["folder"], folder)
    worker = _worker(later["base"], folder)
    write_pointer(folder, [record])
    assert worker.poll() and worker.label == "50" and not worker.error
    full = load_mapped(later["full"] / "mapped_int8.pt", torch.device("cpu"))
    batch = _batch(full)
    diff = (_score(worker.current, batch) - _score(full, batch)).abs().max().item()
    moved = (_score(worker.base, batch) - _score(full, batch)).abs().max().item()
    print(f"max |delta - full export| = {diff:.3g} (base - full: {moved:.3g}), "
          f"{record['rows']} rows, {record['bytes']} bytes")  # fmt: skip
    assert diff <= 1e-5 < moved
    delta = torch.load(folder / record["file"], weights_only=True)
    dense = sum(v.numel() * v.element_size() for v in delta["weights"].values())
    assert 0 < record["rows"] < sum(full.spec["rows"])
    assert record["bytes"] <= 2 * record["rows"] * record["row_bytes"] + dense + 16_384


def test_rows_read_in_blocks_equal_dcp_load(trained: Path) -> None:
    """The direct block reader gives every table's rows exactly as ``dcp.load`` does, over a
    checkpoint of 2 ranks whose C1 is column-wise sharded (chunks of some columns) and whose
    other tables are whole on one rank; blocks of 7 rows cross every chunk boundary."""
    import torch.distributed.checkpoint as dcp

    ckpt = checkpoint.read_latest(trained / "checkpoints")
    assert ckpt is not None
    for feature in SPARSE_NAMES[:3]:
        key = f"{CHECKPOINT_PREFIX}{EBC}.{table_name(feature)}.weight"
        table = TableRows(ckpt, key)
        assert table.direct, key  # read directly, not by the fallback
        chunks = len(table.chunks)
        table.close()
        want = torch.empty(table.rows, table.dim)
        dcp.load({key: want}, checkpoint_id=str(ckpt), no_dist=True)
        blocks = [(first, rows.clone()) for first, rows in table_rows(ckpt, key, 7 * 4 * table.dim)]
        assert [f for f, _ in blocks] == list(range(0, table.rows, 7))
        assert torch.equal(torch.cat([r for _, r in blocks]), want), (key, chunks)
        if feature == "C1":
            assert chunks == 2  # the column-wise shards, joined


@pytest.mark.parametrize("width", [12, 16, 24, 13])
def test_differing_rows_finds_exactly_the_rows_that_differ(width: int) -> None:
    g = torch.Generator().manual_seed(width)
    new = torch.randint(0, 256, (5000, width), dtype=torch.uint8, generator=g)
    ref = new.clone()
    # row 42 differs only in its last byte: the last word of the row (at 16 bytes, an int4 row
    # of dim 16: its scale and bias), which a compare that skips the last word would miss
    for row, col in (
        (0, 0),
        (17, width - 1),
        (4999, width // 2),
        (17, 0),
        (2500, 5),
        (42, width - 1),
    ):
        ref[row, col] ^= 1
    want = (new != ref).any(dim=1).nonzero().flatten()
    assert differing_rows(new, ref).tolist() == want.tolist() == [0, 17, 42, 2500, 4999]
    first_only = new.clone()
    first_only[7, 0] ^= 0x80  # and only its first byte's top bit
    assert differing_rows(new, first_only).tolist() == [7]


def test_a_bad_delta_leaves_the_version_serving(later: dict[str, Any], tmp_path: Path) -> None:
    folder, record = tmp_path / "1.0", later["record"]
    shutil.copytree(later["folder"], folder)
    worker = _worker(later["base"], folder)
    path = folder / record["file"]
    path.write_bytes(path.read_bytes()[:-100])  # a partial copy
    write_pointer(folder, [record])
    assert not worker.poll() and worker.label == "" and "checksum" in worker.error
    assert worker.current is worker.base
    foreign = dict(record, sha256="0" * 64)
    write_pointer(folder, [foreign])
    assert not worker.poll() and worker.label == "" and worker.error


def test_rollback_is_a_swap_and_batches_never_mix(later: dict[str, Any], tmp_path: Path) -> None:
    folder, record = tmp_path / "1.0", later["record"]
    shutil.copytree(later["folder"], folder)
    worker = _worker(later["base"], folder)
    write_pointer(folder, [record])
    assert worker.poll()
    batch = _batch(worker.base, seed=1)
    new, old = _score(worker.current, batch), _score(worker.base, batch)
    write_pointer(folder, [])  # back to the base
    assert worker.poll() and worker.label == "" and worker.current is worker.base
    (folder / record["file"]).unlink()  # forward again with no file to read: the kept chain
    write_pointer(folder, [record])
    assert worker.poll() and worker.label == "50" and not worker.error
    assert read_pointer(folder)["version"] == "50"

    stop, mixed, counts = threading.Event(), [], {"old": 0, "new": 0}

    def flip() -> None:  # the pointer back and forth while batches score
        n = 0
        while not stop.is_set():
            write_pointer(folder, [] if n % 2 else [record])
            worker.poll()
            n += 1

    flipper = threading.Thread(target=flip)
    flipper.start()
    try:
        for _ in range(60):
            model = worker.current  # what the handler takes at a batch's start
            out = _score(model, batch)
            if torch.equal(out, new):
                counts["new"] += 1
            elif torch.equal(out, old):
                counts["old"] += 1
            else:
                mixed.append((out - new).abs().max().item())
    finally:
        stop.set()
        flipper.join()
    assert not mixed, mixed
    print(counts)


@pytest.mark.slow
def test_a_worker_killed_mid_apply_serves_n_or_n1_and_recovers(
    later: dict[str, Any], exported: tuple[Path, Path, str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Real TorchServe, 2 workers: the pointer moves, one worker is SIGKILLed while it applies
    (held 4 s mid-apply); every reply meanwhile is all N or all N+1, and the restarted worker
    comes up serving N+1, acknowledged like the other."""
    folder = tmp_path / "deltas" / "dlrm-tiny" / "1.0"
    shutil.copytree(later["folder"], folder)
    monkeypatch.setenv("RECSYS_DELTA_DIR", str(tmp_path / "deltas"))
    monkeypatch.setenv(APPLY_DELAY_ENV, "4")
    cfg = torchserve_config(exported[1], tmp_path / "ts", workers=2)
    proc = process.start(cfg)
    try:
        wait_all_workers(cfg, proc, STARTUP_TIMEOUT_S)
        key = inference_key(cfg.key_file)
        base = load_mapped(later["base"] / "mapped_int8.pt", torch.device("cpu"))
        full = load_mapped(later["full"] / "mapped_int8.pt", torch.device("cpu"))
        batch = _batch(base, seed=2, batch=64)
        body = encode_request(*(t.numpy() for t in batch))
        # N: the base export; N+1: the full export of the delta's checkpoint (equal: above)
        versions = {"N": _score(base, batch).numpy(), "N+1": _score(full, batch).numpy()}
        write_pointer(folder, [later["record"]])
        seen: list[str] = []

        def served(ch: grpc.Channel) -> str:
            got = decode_response(score(ch, (cfg.model_name, cfg.model_version), body, 60, key))
            near = [v for v, p in versions.items() if np.abs(got - p).max() < 1e-5]
            assert len(near) == 1, {v: float(np.abs(got - p).max()) for v, p in versions.items()}
            return near[0]

        with grpc.insecure_channel(cfg.grpc_inference_target) as ch:
            pids = [w["pid"] for m in process.describe(cfg) for w in m["workers"]]
            seen += [served(ch) for _ in range(5)]  # both workers are inside the apply now
            os.kill(int(pids[0]), signal.SIGKILL)
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            while time.monotonic() < deadline:
                with contextlib.suppress(grpc.RpcError):  # the killed worker's call may fail
                    seen.append(served(ch))
                now = [w for m in process.describe(cfg) for w in m["workers"]]
                ready = [int(w["pid"]) for w in now if w.get("status") == "READY"]
                if len(ready) == 2 and pids[0] not in ready:
                    with contextlib.suppress(RolloutError):
                        wait_served(folder, "50", ready, 1.0)
                        break
            else:
                raise AssertionError(f"workers did not all serve the delta: {now}")
            after = [served(ch) for _ in range(10)]
        assert set(after) == {"N+1"}, after
        assert "N" in seen  # the survivor served N while it applied (held 4 s)
        print(f"while applying and restarting: {seen.count('N')} N, {seen.count('N+1')} N+1")
    finally:
        process.stop(proc)


def test_the_loop_publishes_a_delta_until_the_chain_is_compact_every_long(
    tmp_path: Path,
) -> None:
    """continuous.deltas: a delta over the served default while RUN/export is its export and
    its chain is shorter than compact_every; else (another export, a long chain) a full one."""
    from training.continuous.config import load
    from training.continuous.deltas import delta_target

    serve, run, store = tmp_path / "serve", tmp_path / "run", tmp_path / "store"
    serve.mkdir()
    (run / "export").mkdir(parents=True)
    (serve / "plan.json").write_text(json.dumps({"model": "dlrm-tiny", "default": "40"}))
    schema = {"model": {"name": "dlrm-tiny", "version": "40"}}
    (run / "export" / "schema.json").write_text(json.dumps(schema))
    cfg = load({}, None, ["continuous.data_dir='x'", f"continuous.serve_dir={json.dumps(str(serve))}",
                          "continuous.deltas=true", "continuous.compact_every=2"])  # fmt: skip
    folder = delta_target(cfg, run, store, "dlrm-tiny")
    assert folder == store.resolve() / "deltas" / "dlrm-tiny" / "40"
    folder.mkdir(parents=True)
    write_pointer(folder, [{"file": "a", "sha256": "", "version": "41"}] * 2)
    assert delta_target(cfg, run, store, "dlrm-tiny") is None  # compaction is due
    write_pointer(folder, [])
    schema["model"]["version"] = "39"  # RUN/export is not the default's
    (run / "export" / "schema.json").write_text(json.dumps(schema))
    assert delta_target(cfg, run, store, "dlrm-tiny") is None
