"""``python -m training.data.share``: one share of a run's preprocessing, for a job array.

A Slurm job array (deploy/slurm/prepare.sbatch) runs this once per task, each task on its own
share of the input's parts (:func:`training.data.build.preprocess_share`), all of them writing
into the cache's parts folder on shared storage; the training job, started after the last one
(``--dependency=afterok``), runs ``training.train --prepare-only`` with the same options, finds
every part parsed and only merges them into the cache: the same bytes as one process's. Every
option but ``--share`` / ``--shares`` is the training command line's, so that both name one
cache (``--config``, ``--data``, ``data.cache_dir=...``, ``model.*`` for the table sizes).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from recsys_stack import logs
from training.config import Config, parse_args
from training.errors import RecsysError

log = logging.getLogger(__name__)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def _shown(value: int | None) -> str:
    return "unset here" if value is None else f"{value} here"


def build_parser() -> argparse.ArgumentParser:
    """``--share`` / ``--shares``; the rest of the command line is training.train's."""
    p = argparse.ArgumentParser(
        prog="python -m training.data.share",
        usage="%(prog)s [--share I --shares N] [training.train options and overrides]",
        description=(
            "Parse one share of a training run's input (part k of the input files' 64 MiB "
            "line-aligned parts goes to share k mod N) into its cache's parts folder, and stop. "
            "Once every share has run, `python -m training.train --prepare-only` with the same "
            "options only merges them (the same bytes as one process's cache)."
        ),
        epilog=(
            "Every other argument is passed to training.train's parser (--config, --data, "
            "section.key=value overrides; see `python -m training.train --help`): give both "
            "commands the same ones. In a Slurm array (--array=0-<N-1>) the defaults are "
            "$SLURM_ARRAY_TASK_ID and $SLURM_ARRAY_TASK_COUNT."
        ),
    )
    task, count = _env_int("SLURM_ARRAY_TASK_ID"), _env_int("SLURM_ARRAY_TASK_COUNT")
    p.add_argument(
        "--share", type=int, default=task,
        help=f"this share, 0 .. N-1 (default: $SLURM_ARRAY_TASK_ID: {_shown(task)})",
    )  # fmt: skip
    p.add_argument(
        "--shares", type=int, default=count,
        help=f"how many shares N (default: $SLURM_ARRAY_TASK_COUNT: {_shown(count)})",
    )  # fmt: skip
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    ns, rest = p.parse_known_args(argv)
    if ns.share is None or ns.shares is None:
        p.error("give --share I --shares N (or run as a Slurm array task: --array=0-<N-1>)")
    if ns.shares < 1 or not 0 <= ns.share < ns.shares:
        p.error(
            f"share {ns.share} of {ns.shares}: shares are numbered 0 .. N-1 (a Slurm array "
            f"submitted with --array=0-{max(ns.shares, 1) - 1})"
        )
    logs.configure(logging.INFO, verbose=logs.verbose_requested())
    try:
        args = parse_args(rest)
        run(args.config, ns.share, ns.shares, args.progress)
    except RecsysError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run(cfg: Config, share: int, shares: int, progress: bool) -> None:
    """Share ``share`` of ``shares`` of ``cfg``'s input, unless its cache is complete already
    (torch is imported here, after the command line was checked)."""
    from training.data.binary import cache_path, fingerprint, reusable
    from training.data.build import preprocess_share
    from training.data.criteo import resolve_data_paths
    from training.data.prep import input_paths

    files = [f for path in input_paths(cfg.data, progress) for f in resolve_data_paths(path)]
    tables, inputs = cfg.model.rows(), fingerprint(files)
    out_dir = cache_path(inputs, Path(cfg.data.cache_dir), tables)
    if reusable(out_dir, inputs):
        print(f"share {share} of {shares}: {out_dir} is complete already; nothing to parse")
        return
    parsed, total = preprocess_share(
        files, out_dir, share, shares, on_bad=cfg.data.on_bad_row,
        max_bad_rows=cfg.data.max_bad_rows, progress=progress, rows_per_table=tables,
        processes=cfg.data.preprocess_processes,
    )  # fmt: skip
    print(f"share {share} of {shares}: parsed {parsed} of {total} parts of {out_dir.name}")


if __name__ == "__main__":
    sys.exit(main())
