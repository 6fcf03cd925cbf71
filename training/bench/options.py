"""The training benchmark's command line (``recsys-bench-training``), torch-free so that
``--help`` answers before :mod:`training.bench.run` imports torch (training/launch.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

from recsys_stack import config as shared
from training.config import Config, table_keys_help

DEFAULT_MAX_ROWS = 500_000
DEFAULT_PRESET = Path("training/configs/criteo-kaggle.toml")


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's own flags, then the training config's (``--config``, flags, overrides)."""
    p = shared.ArgumentParser(
        prog="python -m training.bench",
        usage="%(prog)s [bench options] [--config FILE.toml] [config flags] [section.key=value ...]",
        description=(
            "Samples/s of three training steps, measured side by side in one process "
            "(world size 1, gloo on CPU), round-robin over --repeats rounds (median reported): "
            "(1) trainer: batches read from the binary shards by TrainStream (KJT building "
            "included) through the configured TorchRec train pipeline, DMP with the fused "
            "embedding optimizer, the loss window and the periodic logging of the real loop; "
            "(2) ceiling: the raw DMP step (zero_grad, forward, backward, step) of a second "
            "trainer on batches prebuilt in memory; (3) plain: 26 nn.EmbeddingBag(sparse=True) "
            "tables with the same MLPs and dot interaction, torch.optim.Adagrad, on the same "
            "prebuilt batches. Data is synthetic (generated and cached once)."
        ),
        epilog=(
            "The training config is --config (the preset giving the table rows, embedding dim, "
            "MLPs and learning rates) with the bench options above applied to it; the config "
            "flags and section.key=value overrides (as for training.train) apply last. "
            + table_keys_help()
        ),
    )
    bench = p.add_argument_group("benchmark")
    bench.add_argument(
        "--max-rows",
        type=int,
        default=DEFAULT_MAX_ROWS,
        help="cap on each table's rows (criteo-kaggle at 500k: ~0.2 GB per model copy) "
        "[default %(default)s]",
    )
    bench.add_argument(
        "--batch-size", type=int, default=2048, help="per-process batch [default %(default)s]"
    )
    bench.add_argument(
        "--steps",
        type=int,
        default=50,
        help="timed steps per method per round [default %(default)s]",
    )
    bench.add_argument(
        "--warmup",
        type=int,
        default=10,
        help="untimed steps per method per round [default %(default)s]",
    )
    bench.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds; each runs all methods once [default %(default)s]",
    )
    bench.add_argument(
        "--threads", type=int, default=2, help="torch.set_num_threads [default %(default)s]"
    )
    bench.add_argument(
        "--pipeline",
        choices=["sparse_dist", "base"],
        default="sparse_dist",
        help="train pipeline of the trainer row [default %(default)s]",
    )
    bench.add_argument(
        "--prebuilt",
        type=int,
        default=32,
        help="batches built once in memory for the ceiling and plain rows [default %(default)s]",
    )
    bench.add_argument(
        "--synthetic-rows",
        type=int,
        default=300_000,
        help="rows of synthetic data [default %(default)s]",
    )
    bench.add_argument(
        "--synthetic-vocab",
        type=int,
        default=100_000,
        help="distinct ids per synthetic feature (hashed into the capped tables) "
        "[default %(default)s]",
    )
    bench.add_argument(
        "--cache-dir",
        type=Path,
        default=Path("data/cache"),
        help="binary shard cache [default %(default)s]",
    )
    bench.add_argument(
        "--synthetic-dir",
        type=Path,
        default=Path("data/synthetic"),
        help="where the synthetic TSV is generated [default %(default)s]",
    )
    bench.add_argument(
        "--compile-dense",
        action="store_true",
        help="add a 4th row: the trainer with train.compile_dense=true",
    )
    bench.add_argument("--json", type=Path, help="also write the figures to this file")
    bench.add_argument(
        "--no-progress", dest="progress", action="store_false", help="no progress bars"
    )
    shared.add_config_args(p, Config, default_file=DEFAULT_PRESET)
    return p
