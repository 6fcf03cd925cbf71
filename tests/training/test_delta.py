"""Embedding deltas (issue 36): a checkpoint's changed rows over the served export, applied by a
worker's chain, equal to a full export of the same checkpoint; refused whole when bad; swapped
whole (a batch never mixes two versions); rolled back without I/O.

Module fixtures: a copy of the session's tiny run trained 10 steps further (one process,
warm), a full export of that checkpoint (int8, int4, fp16 and a memory budget's mix of them) and
the delta of it over the session's export; then 10 steps more, its full export, and deltas of
that checkpoint: the second of an int8 chain over the session's export, and one each over the
first's int4 and mixed tables."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from recsys_model.delta import read_pointer, update_pointer, write_pointer
from recsys_model.mapped import layout, load_mapped
from serving.bench.servers import wait_all_workers
from serving.tools.deltas import check_workers, move, wait_served
from serving.tools.served import RolloutError
from serving.torchserve import process
from serving.torchserve.client import inference_key, score
from serving.worker.codec import decode_response, encode_request
from serving.worker.deltas import APPLY_DELAY_ENV, DELTA_DIR_ENV, Deltas
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
    schema = json.loads((exported[0] / "schema.json").read_text())
    rows, dim = [t["rows"] for t in schema["tables"]], schema["tables"][0]["dim"]
    int4, int8 = (layout(rows, dim, [f] * len(rows))[2] for f in ("int4", "int8"))
    run_export(["--run-dir", str(run), "--model-store", str(base / "store"), "--version", "2",
                "--formats", '["int8", "int4", "fp16"]', "--memory-budget",
                str((int4 + int8) // 2)])  # fmt: skip
    cfg = config_from_dict(checkpoint.read_meta(ckpt)["config"])
    folder = base / "deltas" / "dlrm-tiny" / "1.0"
    record, _, _ = make_delta(ckpt, cfg.model, exported[0], folder, "50")
    return {"folder": folder, "record": record, "full": run / "export", "base": exported[0],
            "run": run, "cfg": cfg}  # fmt: skip


@pytest.fixture(scope="module")
def chain(
    later: dict[str, Any], data_dirs: list[str], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """10 steps more (60), its full export (int8, int4, fp16), and deltas of it: the second of an
    int8 chain over the session's export (after ``later``'s), one over ``later``'s int4
    tables and one over its mixed tables."""
    base = tmp_path_factory.mktemp("chain")
    run = base / "run"
    shutil.copytree(later["run"], run, ignore=shutil.ignore_patterns("export", ".export*"))
    run_train(["--config", "training/configs/tiny.toml", "--no-progress", "--run-dir", str(run),
               "train.max_steps=60", *data_dirs], nproc=0)  # fmt: skip
    ckpt = checkpoint.read_latest(run / "checkpoints")
    assert ckpt is not None and ckpt.name.endswith("60"), ckpt
    run_export(["--run-dir", str(run), "--model-store", str(base / "store"), "--version", "3",
                "--formats", '["int8", "int4", "fp16"]'])  # fmt: skip
    folder = base / "deltas" / "dlrm-tiny" / "1.0"
    shutil.copytree(later["folder"], folder)
    write_pointer(folder, [later["record"]])
    second, _, _ = make_delta(ckpt, later["cfg"].model, later["base"], folder, "60")
    out = {"folder": folder, "records": [later["record"], second], "full": run / "export"}
    for fmt in ("int4", "mixed"):  # over version 2 (later's export), which serves the mix
        over = base / fmt / "deltas" / "dlrm-tiny" / "2"
        out[fmt] = over, make_delta(ckpt, later["cfg"].model, later["full"], over, "60", fmt)[0]
    return out


def _batch(model: Any, seed: int = 0, batch: int = 256) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    features = len(model.spec["rows"])
    return (torch.randn(batch, int(model.spec["num_dense"]), generator=g),
            torch.randint(0, 10**7, (features * batch,), generator=g),
            torch.ones(features, batch, dtype=torch.int32))  # fmt: skip


def _worker(base_dir: Path, folder: Path, fmt: str = "int8") -> Deltas:
    """A worker's chain over ``base_dir``'s ``fmt`` tables, as the handler builds it."""
    base = load_mapped(base_dir / f"mapped_{fmt}.pt", torch.device("cpu"))
    sha = torch.load(base_dir / f"mapped_{fmt}.pt", weights_only=True)["tables"]["sha256"]
    version = json.loads((base_dir / "schema.json").read_text())["model"]["version"]
    return Deltas(folder, base, str(version), sha, fmt)


def _on_rows(model: Any, rows: torch.Tensor, batch: int = 256) -> tuple[torch.Tensor, ...]:
    """A batch whose every id hits one of ``rows`` (global row ids) where its feature's table
    holds one (ids are ``id mod rows``: a table's row is its own raw id), random elsewhere."""
    g = torch.Generator().manual_seed(7)
    sizes = [int(r) for r in model.spec["rows"]]
    starts = [sum(sizes[:f]) for f in range(len(sizes))]
    values = []
    for first, n in zip(starts, sizes, strict=True):
        mine = rows[(rows >= first) & (rows < first + n)] - first
        pick = torch.randint(0, max(mine.numel(), 1), (batch,), generator=g)
        values.append(mine[pick] if mine.numel() else torch.randint(0, n, (batch,), generator=g))
    dense = torch.randn(batch, int(model.spec["num_dense"]), generator=g)
    return dense, torch.cat(values), torch.ones(len(sizes), batch, dtype=torch.int32)


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


def test_a_two_delta_chain_scores_as_the_full_export_on_the_rows_it_changed(
    later: dict[str, Any], chain: dict[str, Any], tmp_path: Path
) -> None:
    """Base + delta 50 + delta 60 against the full export of 60, on ids both deltas replaced
    (the later must win: an overlay merge that kept the older row fails here), then on ids
    either replaced."""
    folder = tmp_path / "1.0"
    shutil.copytree(chain["folder"], folder)
    worker = _worker(later["base"], folder)
    write_pointer(folder, chain["records"])
    assert worker.poll() and worker.label == "60" and not worker.error, worker.error
    first, second = (torch.load(folder / r["file"], weights_only=True)["ids"]
                     for r in chain["records"])  # fmt: skip
    both = first[torch.isin(first, second)]
    assert both.numel() > 0  # rows both passes changed: the merge order decides them
    full = load_mapped(chain["full"] / "mapped_int8.pt", torch.device("cpu"))
    for rows in (both, torch.cat([first, second]).unique()):
        batch = _on_rows(full, rows)
        diff = (_score(worker.current, batch) - _score(full, batch)).abs().max().item()
        moved = (_score(worker.base, batch) - _score(full, batch)).abs().max().item()
        print(f"{rows.numel()} rows: max |chain - full export| = {diff:.3g} (base: {moved:.3g})")
        assert diff <= 1e-5 < moved


def test_a_delta_out_of_its_chain_order_is_refused(
    later: dict[str, Any], chain: dict[str, Any], tmp_path: Path
) -> None:
    """The worker's parent check: delta 60 (made over 50) alone, or before 50, is refused and
    the base keeps serving; in order both apply."""
    folder = tmp_path / "1.0"
    shutil.copytree(chain["folder"], folder)
    worker = _worker(later["base"], folder)
    first, second = chain["records"]
    for wrong in ([second], [second, first]):
        write_pointer(folder, wrong)
        assert not worker.poll() and worker.label == "" and worker.current is worker.base
        assert "follows '50', not ''" in worker.error, worker.error
    write_pointer(folder, [first, second])
    assert worker.poll() and worker.label == "60" and not worker.error


@pytest.mark.parametrize("fmt", ["int4", "mixed"])
def test_int4_and_mixed_tables_take_deltas_of_their_own_format(
    later: dict[str, Any], chain: dict[str, Any], fmt: str, tmp_path: Path
) -> None:
    """A worker serving int4 (or a memory budget's mix, section by section) applies the
    delta made for its tables and then pools every table as the full export of the same
    checkpoint in that table's format does; an int8 delta is refused naming the format."""
    over, record = chain[fmt]
    folder = tmp_path / "2"
    shutil.copytree(over, folder)
    worker = _worker(later["full"], folder, fmt)
    assert record["format"] == fmt and record["rows"] > 0
    write_pointer(folder, [record])
    assert worker.poll() and worker.label == "60" and not worker.error, worker.error
    tables = json.loads((later["full"] / "schema.json").read_text())["variants"][fmt]["tables"]
    formats = tables.get("formats") or [fmt] * len(worker.base.spec["rows"])  # one a table
    assert fmt != "mixed" or len(set(formats)) > 1, formats  # sections of two formats
    full = {f: load_mapped(chain["full"] / f"mapped_{f}.pt", torch.device("cpu"))
            for f in set(formats)}  # fmt: skip
    _, values, lengths = _batch(worker.base, seed=3)
    with torch.inference_mode():
        got = worker.current.pooled(values, lengths)
        base = worker.base.pooled(values, lengths)
        want = torch.stack([full[f].pooled(values, lengths)[:, t] for t, f in enumerate(formats)],
                           dim=1)  # fmt: skip
    diff, moved = (got - want).abs().max().item(), (base - want).abs().max().item()
    print(f"{fmt}: {record['rows']} rows, max |pooled - full export's| = {diff:.3g} "
          f"(base: {moved:.3g})")  # fmt: skip
    assert diff <= 1e-5 < moved
    wrong = tmp_path / "int8" / "1.0"
    shutil.copytree(later["folder"], wrong)
    other = Deltas(wrong, worker.base, "1.0", "x", fmt)
    write_pointer(wrong, [later["record"]])
    assert not other.poll() and other.current is other.base
    assert f"a delta of int8 rows; this worker serves {fmt} tables" in other.error, other.error


@pytest.mark.parametrize("case", ["int8 chain", "int4"])
def test_a_delta_of_the_touched_rows_equals_the_one_of_every_row(
    later: dict[str, Any], chain: dict[str, Any], case: str, tmp_path: Path
) -> None:
    """The continuous loop diffs only the rows its passes trained (``touched``, a superset):
    given the rows the full scan found changed plus as many untouched-by-change ones, the delta
    holds the same ids and bytes (the int8 one second in a chain, compared with the chain's
    rows; the int4 one over a fresh base); given a set that misses changed rows, it misses
    them (the rows really come from ``touched``)."""
    if case == "int4":
        over, record = chain["int4"]
        base_dir, fmt = later["full"], "int4"
    else:
        over, record, base_dir, fmt = chain["folder"], chain["records"][1], later["base"], "int8"
    full = torch.load(over / record["file"], weights_only=True)
    served = load_mapped(base_dir / f"mapped_{fmt}.pt", torch.device("cpu"))
    sizes = [int(r) for r in served.spec["rows"]]
    local, _, _ = layout(sizes, served.dim, [fmt] * len(sizes))
    ids = full["ids"].numpy()
    rng = np.random.default_rng(0)
    touched = []
    for t, n in enumerate(sizes):
        mine = ids[(ids >= local[t]) & (ids < local[t] + n)] - local[t]
        extra = rng.integers(0, n, max(len(mine), 3))
        touched.append(np.unique(np.concatenate([mine, extra])))
    ckpt = Path(full["checkpoint"])
    for name, rows in (("superset", touched), ("half", [t[: len(t) // 2] for t in touched])):
        folder = tmp_path / name / over.name
        shutil.copytree(over, folder, ignore=shutil.ignore_patterns(record["file"], "acks"))
        got, _, _ = make_delta(ckpt, later["cfg"].model, base_dir, folder, "60", fmt, rows)
        mine = torch.load(folder / got["file"], weights_only=True)
        same = torch.equal(mine["ids"], full["ids"]) and torch.equal(mine["rows"], full["rows"])
        print(f"{case} {name}: {got['rows']} of {record['rows']} rows")
        assert same == (name == "superset"), (name, got["rows"], record["rows"])


def test_only_acks_of_the_pointer_count(later: dict[str, Any], tmp_path: Path) -> None:
    """An ack written before the pointer moved says nothing of it: a repeated label (another
    file) is not 'served' until the worker answers the new pointer, and an error the worker
    reported for an earlier pointer does not refuse this one; a refusal of this one is
    reported with the worker's own error, at once."""
    folder, record = tmp_path / "1.0", later["record"]
    shutil.copytree(later["folder"], folder)
    worker, pids = _worker(later["base"], folder), [os.getpid()]
    write_pointer(folder, [record])
    assert worker.poll() and worker.label == "50"  # acked: "50", the first file
    again = {**record, "file": "0002-50.pt"}  # the same label, another file
    shutil.copy(folder / record["file"], folder / again["file"])
    with pytest.raises(RolloutError, match="do not acknowledge '50'"):
        move(folder, lambda _: [again], pids, 0.5)  # nobody answers: put back
    assert read_pointer(folder)["chain"] == [record]
    broken = {**record, "file": "0003-51.pt", "version": "51", "sha256": "0" * 64}
    shutil.copy(folder / record["file"], folder / broken["file"])
    write_pointer(folder, [record, broken])
    assert not worker.poll() and "checksum" in worker.error  # acked with that error
    t0 = time.monotonic()
    with pytest.raises(RolloutError, match="do not acknowledge '50'"):
        move(folder, lambda _: [again], pids, 0.5)  # its old error is no refusal of this one
    assert time.monotonic() - t0 >= 0.5
    watcher = worker.watch()
    try:
        moved = move(folder, lambda _: [again], pids, 10)
        ack = json.loads((folder / "acks" / f"{os.getpid()}.json").read_text())
        assert moved["served_s"] > 0 and ack["file"] == again["file"] and not ack["error"]
        assert ack["pointer_time"] == read_pointer(folder)["time"] == moved["pointer_time"]
        t0 = time.monotonic()
        with pytest.raises(RolloutError, match=r"refused 51: .*checksum.*; back to 50"):
            move(folder, lambda chain: [*chain, broken], pids, 10)
        assert time.monotonic() - t0 < 5  # refused when it answered, not at the timeout
    finally:
        worker.stop()
        watcher.join()
    assert worker.label == "50" and read_pointer(folder)["chain"] == [again]


def _handler(model_dir: Path) -> Any:
    """The handler as TorchServe starts it on the unpacked .mar ``model_dir``."""
    from serving.worker.handler import RecsysHandler

    manifest = json.loads((model_dir / "MAR-INF" / "MANIFEST.json").read_text())
    context = SimpleNamespace(system_properties={"model_dir": str(model_dir), "gpu_id": None},
                              manifest=manifest)  # fmt: skip
    handler = RecsysHandler()
    handler.initialize(context)
    return handler


def test_a_worker_without_a_delta_path_says_so_and_the_publish_refuses_at_once(
    exported: tuple[Path, Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker serving fp16 tables acknowledges at its start that it takes no delta (before,
    it wrote nothing and a publish waited out its timeout twice); one serving int8 says its
    format, and a delta of another format is refused before the pointer moves."""
    model_dir = tmp_path / "mar"
    zipfile.ZipFile(exported[1] / "dlrm-tiny-1.0.mar").extractall(model_dir)
    monkeypatch.setenv("RECSYS_WARM_UP", "0")
    monkeypatch.setenv(DELTA_DIR_ENV, str(tmp_path / "deltas"))
    monkeypatch.setenv("RECSYS_VARIANT", "fp16")
    folder, pids = tmp_path / "deltas" / "dlrm-tiny" / "1.0", [os.getpid()]
    assert _handler(model_dir).deltas is None
    ack = json.loads((folder / "acks" / f"{os.getpid()}.json").read_text())
    assert ack["deltas"] is False and "serves fp16" in ack["error"], ack
    with pytest.raises(RolloutError, match="takes no delta: this worker serves fp16"):
        check_workers(folder, pids, "int8")
    t0 = time.monotonic()
    with pytest.raises(RolloutError, match="refused"):
        wait_served(folder, {"chain": [], "time": time.time()}, pids, 30)
    assert time.monotonic() - t0 < 5
    monkeypatch.delenv("RECSYS_VARIANT")
    handler = _handler(model_dir)  # int8, the archive's CPU choice
    try:
        ack = json.loads((folder / "acks" / f"{os.getpid()}.json").read_text())
        assert ack["deltas"] and ack["format"] == "int8" and ack["pointer_time"] == 0, ack
        check_workers(folder, pids, "int8")
        with pytest.raises(RolloutError, match="serves int8 tables, the delta is of int4 rows"):
            check_workers(folder, pids, "int4")
    finally:
        handler.deltas.stop()


def test_the_gate_is_judged_by_the_rollouts_rules(tmp_path: Path) -> None:
    """The delta's scores are judged as a rollout judges its candidate: the margin from the
    rollout's arguments (not a constant of the delta path), the near-chance refusal."""
    from serving.tools.deltas import judge

    rng = np.random.default_rng(0)
    y = (rng.random(4000) < 0.3).astype(np.float64)
    good = np.clip(0.3 + 0.4 * (y - 0.3) + rng.normal(0, 0.15, y.size), 0.01, 0.99)
    worse = np.where(rng.random(y.size) < 0.02, 1 - good, good)  # a little lower AUC
    path = tmp_path / "judge.npz"
    np.savez(path, labels=y, default=good, candidate=worse)
    drop = judge(path, [])["auc_default"] - judge(path, [])["auc_candidate"]
    assert 0.002 < drop < 0.05, drop
    assert not judge(path, [])["passed"]  # the rollout's default margin, 0.002
    assert judge(path, ["--margin", "0.05", "--steps", "100"])["passed"]
    np.savez(path, labels=y, default=rng.random(y.size), candidate=rng.random(y.size))
    near = judge(path, ["--margin", "0.5"])
    assert not near["passed"] and "neither fits these rows" in near["verdict"], near


def test_the_pointer_is_changed_under_its_lock(tmp_path: Path) -> None:
    """Publishes and rollbacks racing each other lose none: each change reads and writes the
    pointer under one lock, and each write is later than the one it replaces."""
    folder = tmp_path / "1.0"
    folder.mkdir()
    times: list[float] = []

    def publish(n: int) -> None:
        for i in range(40):
            entry = {"file": f"{n}-{i}", "sha256": "", "version": f"{n}-{i}"}
            times.append(update_pointer(folder, lambda chain, e=entry: [*chain, e])[1]["time"])

    threads = [threading.Thread(target=publish, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(read_pointer(folder)["chain"]) == 120
    assert len(set(times)) == 120 and read_pointer(folder)["time"] == max(times)


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
                        wait_served(folder, read_pointer(folder), ready, 1.0)
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
    from training.continuous.deltas import counted, delta_target, try_delta

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
    base = {"model": "dlrm-tiny", "version": "41", "step": 41}
    assert try_delta(cfg, run, store, base, tmp_path / "next.tsv", 0.0) is None  # a full one
    # served fp16 tables (or TorchScript): no delta path, the record says why, a full export
    schema = {"model": {"name": "dlrm-tiny", "version": "40"}, "serving": {"cpu": "fp16"},
              "variants": {"fp16": {"kind": "mapped", "file": "mapped_fp16.pt"}}}  # fmt: skip
    (run / "export" / "schema.json").write_text(json.dumps(schema))
    record = try_delta(cfg, run, store, base, tmp_path / "next.tsv", 0.0)
    assert record is not None and record["fallback"] and not record["promoted"], record
    assert "serve fp16 (mapped): no delta path" in record["reason"], record
    assert not counted([record]) and counted([record, {"event": "export", "ok": True}])
    assert not counted([{"event": "file", "step": 40}]) and counted([{**record, "promoted": True}])
