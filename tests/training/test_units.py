"""Pure-function tests: config parsing, the batch stream, eval padding, checkpoint bookkeeping."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata

from training.checkpoint import rowwise
from training.checkpoint import store as checkpoint
from training.config import load_config, parse_args
from training.data.loader import Arrays, TrainStream, eval_batches, make_batch
from training.errors import CheckpointError, ConfigError
from training.features import MISSING_ID, NUM_DENSE, NUM_SPARSE, dense_transform, hash_ids

TINY = "training/configs/tiny.toml"


# ----------------------------------------------------------------------------- config


def test_presets_load_and_validate() -> None:
    for name in ("tiny", "demo", "criteo-kaggle"):
        cfg = load_config(f"training/configs/{name}.toml")
        assert cfg.name == name
        assert len(cfg.model.rows()) == NUM_SPARSE


def test_overrides_take_toml_values_and_nested_tables() -> None:
    cfg = load_config(
        TINY,
        [
            "train.max_steps=7",
            "optim.dense_lr=1",  # an int where a float is expected is fine
            'sharding.tables.t_C5.sharding_types=["column_wise"]',
            "sharding.tables.t_C5.min_partition=4",
        ],
    )
    assert cfg.train.max_steps == 7 and cfg.optim.dense_lr == 1.0
    assert cfg.sharding.tables["t_C5"].sharding_types == ["column_wise"]
    assert cfg.sharding.tables["t_C5"].min_partition == 4


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("train.batch_size=0", "train.batch_size = 0: must be >= 1"),
        ("train.batch_size=1.5", "expected int"),
        ("model.dense_arch=[16,4]", "must match"),
        ("model.over_arch=[16,2]", "ending with 1"),
        ("data.eval_fraction=1.0", "must be in (0, 1)"),
        ("data.preprocess_processes=-1", "data.preprocess_processes = -1: must be >= 0"),
        ("sharding.tables.t_C99.sharding_types=[]", "sharding.tables.t_C99: no such table"),
        ('optim.embedding="lamb"', "must be one of"),
        ("nonsense", "expected section.key=value"),
        ("model.bottom=3", "unknown key 'model.bottom'"),
    ],
)
def test_bad_values_name_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    assert message in str(e.value)


def test_error_in_file_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train]\nbatch_sise = 3\n")
    with pytest.raises(
        ConfigError,
        match=r"bad.toml: unknown key 'train.batch_sise' \(did you mean 'train.batch_size'\?\)",
    ):
        load_config(bad)


def test_parse_args_defaults_run_dir_to_preset_name() -> None:
    args = parse_args(["--config", TINY, "--data", "x.tsv"])
    assert args.run_dir == Path("runs/tiny")
    assert args.config.data.path == "x.tsv"


# ----------------------------------------------------------------------------- features + batches


def _arrays(n: int, seed: int = 0, with_prob: bool = True) -> Arrays:
    rng = np.random.default_rng(seed)
    sparse = rng.integers(0, 2**32, size=(n, NUM_SPARSE), dtype=np.int64)
    sparse[rng.random((n, NUM_SPARSE)) < 0.1] = MISSING_ID
    return Arrays(
        labels=rng.integers(0, 2, n).astype(np.int8),
        dense=rng.integers(-3, 1000, size=(n, NUM_DENSE)).astype(np.float32),
        sparse=sparse,
        prob=rng.random(n).astype(np.float32) if with_prob else None,
    )


def test_transforms() -> None:
    x = torch.tensor([[-3.0, 0.0, 1.0, 1e6]])
    assert torch.allclose(
        dense_transform(x), torch.tensor([[0.0, 0.0, float(np.log(2.0)), float(np.log1p(1e6))]])
    )
    ids = torch.tensor([0, 5, 2**40 + 3], dtype=torch.int64)
    assert hash_ids(ids, torch.tensor(4)).tolist() == [0, 1, 3]


def test_make_batch_builds_feature_major_kjt_with_missing_as_empty() -> None:
    arr = _arrays(5)
    rows = np.array([7 + i for i in range(NUM_SPARSE)], dtype=np.int64)
    mb = make_batch(arr, np.arange(5), rows)
    kjt = mb.batch.sparse_features
    for f, name in enumerate(kjt.keys()):
        jt = kjt[name]
        lengths = jt.lengths().tolist()
        assert lengths == [int(v >= 0) for v in arr.sparse[:, f]]
        expected = [int(v) % int(rows[f]) for v in arr.sparse[:, f] if v >= 0]
        assert jt.values().tolist() == expected
        assert jt.values().dtype == torch.int64
    assert mb.batch.dense_features.shape == (5, NUM_DENSE)


def _global_batches(arr: Arrays, world: int, steps: int, **kw: int) -> list[np.ndarray]:
    streams = [
        iter(
            TrainStream(
                arr,
                global_batch=8,
                rank=r,
                world_size=world,
                rows_per_table=[97] * NUM_SPARSE,
                seed=3,
                epochs=2,
                **kw,
            )
        )
        for r in range(world)
    ]
    out = []
    for _ in range(steps):
        labels = [next(s).dense_features for s in streams]
        out.append(torch.cat(labels).numpy())
    return out


def test_stream_sees_the_same_global_batches_on_any_world_size() -> None:
    arr = _arrays(50)
    one = _global_batches(arr, world=1, steps=10)
    two = _global_batches(arr, world=2, steps=10)
    for a, b in zip(one, two, strict=True):
        # Each rank sorts its slice for sequential reads; the set of rows is what must match.
        assert sorted(map(tuple, a)) == sorted(map(tuple, b))


def test_stream_resumes_mid_epoch_and_crosses_epochs() -> None:
    arr = _arrays(50)  # 7 steps per epoch: 6 of 8 rows, then 2 rows padded to 8
    full = _global_batches(arr, world=1, steps=9)
    resumed = _global_batches(arr, world=2, steps=5, start_epoch=0, start_row=32)  # after step 4
    for a, b in zip(full[4:], resumed, strict=True):
        assert sorted(map(tuple, a)) == sorted(map(tuple, b))
    assert not np.array_equal(full[0], full[6])  # epoch 2 reshuffles


@pytest.mark.parametrize(("n", "world", "batch"), [(10, 1, 4), (10, 2, 4), (3, 2, 4), (17, 2, 3)])
def test_eval_batches_cover_every_row_once(n: int, world: int, batch: int) -> None:
    arr = _arrays(n)
    seen: list[float] = []
    counts = []
    for rank in range(world):
        bs = list(
            eval_batches(
                arr, batch_size=batch, rank=rank, world_size=world, rows_per_table=[5] * NUM_SPARSE
            )
        )
        counts.append(len(bs))
        for mb in bs:
            assert mb.batch.labels.shape[0] == batch
            assert mb.prob is not None
            seen.extend(mb.prob[mb.weights > 0].tolist())
    assert len(set(counts)) == 1  # every rank runs the same number of collective steps
    assert sorted(seen) == sorted(arr.prob.tolist())  # type: ignore[union-attr]


# ----------------------------------------------------------------------------- checkpoints


def _fake_complete(root: Path, step: int) -> Path:
    d = root / checkpoint.step_dir_name(step)
    d.mkdir(parents=True)
    (d / ".metadata").write_bytes(b"x")
    (d / checkpoint.META).write_text("{}")
    return d


def test_resolve_prefers_latest_and_ignores_partial(tmp_path: Path) -> None:
    assert checkpoint.resolve("auto", tmp_path) is None
    (tmp_path / "step_00000005.partial").mkdir()
    assert checkpoint.resolve("auto", tmp_path) is None  # only an interrupted save: fresh start
    d = _fake_complete(tmp_path, 3)
    (tmp_path / checkpoint.LATEST).write_text(d.name + "\n")
    assert checkpoint.resolve("auto", tmp_path) == d
    assert checkpoint.resolve("none", tmp_path) is None
    assert checkpoint.resolve(str(d), tmp_path) == d
    with pytest.raises(CheckpointError, match="incomplete"):
        checkpoint.resolve(str(tmp_path / "step_00000005.partial"), tmp_path)
    with pytest.raises(CheckpointError, match="not found"):
        checkpoint.resolve(str(tmp_path / "nope"), tmp_path)


def test_prune_keeps_the_newest_and_removes_partials(tmp_path: Path) -> None:
    for s in (1, 2, 3, 4):
        _fake_complete(tmp_path, s)
    (tmp_path / "step_00000009.partial").mkdir()
    (tmp_path / checkpoint.LATEST).write_text("step_00000004\n")
    checkpoint._prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step_00000003",
        "step_00000004",
    ]


def test_compatibility_check_names_the_field(tmp_path: Path) -> None:
    meta = {"config": {"model": {"embedding_dim": 8, "num_embeddings": 128}}}
    checkpoint.check_compatible(tmp_path, meta, {"embedding_dim": 8, "num_embeddings": 128})
    with pytest.raises(CheckpointError, match=r"model\.num_embeddings=128 but this config has 256"):
        checkpoint.check_compatible(tmp_path, meta, {"embedding_dim": 8, "num_embeddings": 256})


def test_rowwise_accumulator_conversion_is_the_width_weighted_mean(tmp_path: Path) -> None:
    rows = 6
    key = "optim.state.x.t_C1.weight.t_C1.momentum1"
    saved = torch.arange(3 * rows, dtype=torch.float32)  # 3 column shards of widths 8, 4, 4
    dcp.save({key: saved}, checkpoint_id=str(tmp_path), no_dist=True)
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata[key]
    target = torch.zeros(2 * rows)  # resumed with 2 column shards
    rowwise.load_rowwise(tmp_path, key, md, target, rows, widths=[8, 4, 4])  # type: ignore[arg-type]
    per = saved.view(3, rows)
    canonical = per[0] * 0.5 + per[1] * 0.25 + per[2] * 0.25
    assert torch.allclose(target, canonical.repeat(2))


class _LocalShards:
    """What a ShardedTensor shows of itself to the conversion: this rank's shards, the size."""

    def __init__(self, size: int, shards: list[Shard]) -> None:
        self.shards, self.global_size = shards, torch.Size([size])

    def local_shards(self) -> list[Shard]:
        return self.shards

    def size(self) -> torch.Size:
        return self.global_size


def _shard(offset: int, size: int) -> Shard:
    return Shard(torch.full((size,), -1.0), ShardMetadata([offset], [size], "rank:0/cpu"))


def test_rowwise_accumulator_resumes_onto_row_wise_shards(tmp_path: Path) -> None:
    """Saved column-wise (3 shards), resumed row-wise (TorchRec's GPU plan; the planner does
    not make it on CPU, so the shard metadata is built by hand): each row-range shard gets its
    own rows of the canonical accumulator, at its offset."""
    rows = 10
    key = "optim.state.x.t_C1.weight.t_C1.momentum1"
    saved = torch.rand(3 * rows)
    dcp.save({key: saved}, checkpoint_id=str(tmp_path), no_dist=True)
    md = dcp.FileSystemReader(str(tmp_path)).read_metadata().state_dict_metadata[key]
    per = saved.view(3, rows)
    canonical = per[0] * 0.5 + per[1] * 0.25 + per[2] * 0.25
    # 4-way row-wise [0:3) [3:6) [6:8) [8:10): this rank holds the 2nd and the 4th
    target = _LocalShards(rows, [_shard(3, 3), _shard(8, 2)])
    rowwise.load_rowwise(tmp_path, key, md, target, rows, widths=[8, 4, 4])  # type: ignore[arg-type]
    assert torch.allclose(target.shards[0].tensor, canonical[3:6])
    assert torch.allclose(target.shards[1].tensor, canonical[8:10])
    # column-wise again, 2 blocks of `rows`: this rank holds the second block
    target = _LocalShards(2 * rows, [_shard(rows, rows)])
    rowwise.load_rowwise(tmp_path, key, md, target, rows, widths=[8, 4, 4])  # type: ignore[arg-type]
    assert torch.allclose(target.shards[0].tensor, canonical)
    # table-wise: one shard of all rows on this rank
    target = _LocalShards(rows, [_shard(0, rows)])
    rowwise.load_rowwise(tmp_path, key, md, target, rows, widths=[8, 4, 4])  # type: ignore[arg-type]
    assert torch.allclose(target.shards[0].tensor, canonical)


def test_fill_rowwise_places_every_layout_by_offset() -> None:
    canonical = torch.arange(6.0)
    parts = [(0, torch.zeros(4)), (4, torch.zeros(2)), (6, torch.zeros(6)), (9, torch.zeros(3))]
    rowwise.fill_rowwise(canonical, parts)
    assert [t.tolist() for _, t in parts] == [
        [0, 1, 2, 3],  # row range [0, 4)
        [4, 5],  # row range [4, 6)
        [0, 1, 2, 3, 4, 5],  # the second column shard's block
        [3, 4, 5],  # any slice of [rows * k'] maps position g to row g mod rows
    ]
