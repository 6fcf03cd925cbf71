"""Synthetic Criteo-format data with a planted, learnable click model and its true probabilities.

The click model (per-id effects, dense effects, a low-rank interaction, Zipf-distributed ids
written as 8 hex digits) and how rows are sampled from it: :mod:`training.data.planted`.
Output: the TSV and ``<name>.prob.npy`` (``float32[rows]``, the true click probability of row
``i`` = line ``i + 1``). Bytes depend only on ``(spec, chunk_rows)``. ``--days N --drift D``
writes N days whose click model and id popularity drift: :mod:`training.data.drift`.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Generator, Sequence
from contextlib import ExitStack, closing
from multiprocessing.pool import AsyncResult
from pathlib import Path

import numpy as np

from recsys_stack.metrics import roc_auc
from recsys_stack.progress import progress as progress_bar
from training.data.drift import day_models, drift_report
from training.data.parts import append_file, cpu_cores, init_worker
from training.data.planted import (
    DEFAULT_VOCAB,
    Block,
    PlantedModel,
    SyntheticSpec,
    build_model,
    raw_ids,
    sample_block,
)
from training.features import NUM_DENSE, NUM_SPARSE

__all__ = [
    "DEFAULT_VOCAB", "Block", "PlantedModel", "SyntheticSpec", "build_model", "format_block",
    "generate", "main", "prob_sidecar", "raw_ids", "sample_block",
]  # fmt: skip
log = logging.getLogger(__name__)
_INT_STR_MIN = -3
_INT_STR = np.array([str(i) for i in range(_INT_STR_MIN, 1 << 16)], dtype=object)


def prob_sidecar(tsv: Path) -> Path:
    """``x.tsv`` -> ``x.prob.npy``: where a synthetic file keeps its true probabilities."""
    return tsv.with_suffix(".prob.npy")


def format_block(model: PlantedModel, block: Block) -> str:
    """TSV text of a block, one ``'\\n'``-terminated line per row, missing fields empty."""
    cols: list[list[str]] = [np.array(["0", "1"])[block.labels].tolist()]
    # Looking small ints up in a table of strings is ~20x faster than ``astype(str)``.
    small = (block.dense >= _INT_STR_MIN) & (block.dense < _INT_STR_MIN + len(_INT_STR))
    dense = _INT_STR[np.where(small, block.dense - _INT_STR_MIN, 0)]
    dense[~small] = [str(x) for x in block.dense[~small].tolist()]
    dense[block.dense_missing] = ""
    cols += [dense[:, j].tolist() for j in range(NUM_DENSE)]
    cols += [model.hex_tables[f][block.ranks[:, f]].tolist() for f in range(NUM_SPARSE)]
    return "\n".join(map("\t".join, zip(*cols, strict=True))) + "\n"


def generate(
    spec: SyntheticSpec,
    out_tsv: Path,
    chunk_rows: int = 100_000,
    progress: bool = True,
    model: PlantedModel | None = None,
    salt: Sequence[int] = (),
    processes: int = 0,
) -> Path:
    """Write ``spec.rows`` rows to ``out_tsv`` and their true probabilities to its sidecar.

    ``model``: the planted model to sample (default: ``build_model(spec)``); ``salt``: extra
    seed words for the rows (the drifting days draw other rows each day). Both files are
    written under temporary names and renamed into place at the end, so an interrupted run
    never leaves a partial file under the final name. ``processes`` (0: one per core) sample
    and format the blocks, written in order: the bytes do not depend on it. Returns ``out_tsv``.
    """
    out_tsv = Path(out_tsv)
    out_tsv.parent.mkdir(parents=True, exist_ok=True)
    sidecar = prob_sidecar(out_tsv)
    tmp_tsv = out_tsv.with_name(f".{out_tsv.name}.tmp-{os.getpid()}")
    tmp_prob = sidecar.with_name(f".{sidecar.name}.tmp-{os.getpid()}")
    model = build_model(spec) if model is None else model
    probs = np.empty(spec.rows, np.float32)
    labels = np.empty(spec.rows, np.int8)
    try:
        with (
            ExitStack() as stack,
            tmp_tsv.open("wb", buffering=0) as f,
            progress_bar(
                total=spec.rows,
                unit="row",
                unit_scale=True,
                desc="generate",
                disable=not progress,
            ) as bar,
        ):
            starts = range(0, spec.rows, chunk_rows)
            parts = out_tsv.with_name(f".{out_tsv.name}.parts-{os.getpid()}")
            blocks = stack.enter_context(
                closing(_blocks(model, spec, salt, chunk_rows, processes, parts))
            )
            for start, (text, prob, label) in zip(starts, blocks, strict=True):
                if isinstance(text, Path):
                    append_file(text, f)
                    text.unlink()
                else:
                    view = memoryview(text)
                    while view:  # a raw file may take part of a write
                        view = view[f.write(view) :]
                probs[start : start + len(prob)] = prob
                labels[start : start + len(prob)] = label
                bar.update(len(prob))
        with tmp_prob.open("wb") as fp:
            np.save(fp, probs)
        os.replace(tmp_prob, sidecar)
        os.replace(tmp_tsv, out_tsv)
    finally:
        tmp_tsv.unlink(missing_ok=True)
        tmp_prob.unlink(missing_ok=True)
    if 0 < labels.sum() < len(labels):
        log.info(
            "wrote %d rows to %s: ctr %.4f, mean prob %.4f, oracle auc %.4f",
            spec.rows,
            out_tsv,
            labels.mean(),
            probs.mean(),
            roc_auc(labels, probs),
        )
    return out_tsv


Chunk = tuple[bytes | Path, np.ndarray, np.ndarray]  # TSV bytes (or a file of them), p, labels
_JOB: tuple[PlantedModel, SyntheticSpec, tuple[int, ...], int] | None = None  # forked workers'


def _block(i: int, folder: Path | None = None) -> Chunk:
    """Block ``i`` of the file being generated (its rows depend on ``i`` alone); its text in
    ``folder/<i>`` when given (a worker's: the writer then copies it in the kernel, instead of
    taking 25 MB a block through a pipe on the cores the workers need)."""
    assert _JOB is not None
    model, spec, salt, chunk_rows = _JOB
    n = min(chunk_rows, spec.rows - i * chunk_rows)
    block = sample_block(model, spec, np.random.default_rng([spec.seed, 2, *salt, i]), n)
    text = format_block(model, block).encode("ascii")
    if folder is None:
        return text, block.prob, block.labels
    (folder / str(i)).write_bytes(text)
    return folder / str(i), block.prob, block.labels


def _blocks(
    model: PlantedModel,
    spec: SyntheticSpec,
    salt: Sequence[int],
    chunk_rows: int,
    processes: int,
    folder: Path,
) -> Generator[Chunk, None, None]:
    """The blocks in order, sampled by ``processes`` forked workers (at most two blocks each
    ahead of the writer, their text in files under ``folder``), or here when one is enough."""
    global _JOB
    count = -(-spec.rows // chunk_rows)
    processes = min(processes or cpu_cores(), count)
    _JOB = (model, spec, tuple(salt), chunk_rows)
    try:
        if processes <= 1 or "fork" not in mp.get_all_start_methods():
            yield from map(_block, range(count))
            return
        folder.mkdir()
        with mp.get_context("fork").Pool(processes, initializer=init_worker) as pool:
            ahead: deque[AsyncResult[Chunk]] = deque()
            for i in range(count):
                ahead.append(pool.apply_async(_block, (i, folder)))
                if len(ahead) > 2 * processes:
                    yield ahead.popleft().get()
            while ahead:
                yield ahead.popleft().get()
    finally:
        _JOB = None
        shutil.rmtree(folder, ignore_errors=True)


def day_file(out_dir: Path, day: int) -> Path:
    """``OUT/day_<day>.tsv``."""
    return Path(out_dir) / f"day_{day}.tsv"


def generate_days(
    spec: SyntheticSpec,
    days: int,
    drift: float,
    out_dir: Path,
    chunk_rows: int = 100_000,
    progress: bool = True,
) -> list[Path]:
    """Write ``OUT/day_<d>.tsv`` (``spec.rows`` rows each, other rows every day) and their
    ``.prob.npy``, the planted model moving by ``drift`` a day (:mod:`training.data.drift`);
    each file appears complete, by rename (:func:`generate`)."""
    out = []
    for day, model in enumerate(day_models(spec, days, drift)):
        path = day_file(out_dir, day)
        generate(spec, path, chunk_rows, progress, model=model, salt=(3, day))
        out.append(path)
    return out


def main_days(
    spec: SyntheticSpec, days: int, drift: float, out_dir: Path, chunk_rows: int, quiet: bool
) -> int:
    """``--days``: write the files, then print what the drift costs a model frozen on day 0."""
    if days < 1 or not 0.0 <= drift <= 1.0:
        print(f"error: --days {days} --drift {drift}: days >= 1, drift in [0, 1]", file=sys.stderr)
        return 2
    start = time.perf_counter()
    paths = generate_days(spec, days, drift, out_dir, chunk_rows, progress=not quiet)
    seconds = time.perf_counter() - start
    print(f"{out_dir}: {days} days of {spec.rows} rows, drift {drift:g}, in {seconds:.1f}s")
    for r in drift_report(spec, days, drift, min(spec.rows, 50_000)):
        print(
            f"  {paths[r.day].name} (+ {prob_sidecar(paths[r.day]).name}): oracle AUC "
            f"{r.oracle_auc:.4f}, day 0's click model {r.day0_auc:.4f} (-{r.loss:.4f})"
        )
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Command-line options of ``python -m training.data.synthetic``."""
    d = SyntheticSpec()
    p = argparse.ArgumentParser(
        prog="python -m training.data.synthetic",
        description="Write synthetic Criteo-format TSV (label, I1..I13, C1..C26) with a planted "
        "click model, plus <out>.prob.npy holding each row's true click probability.",
    )
    p.add_argument("--rows", type=int, default=d.rows, help="rows to write (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="seed (default %(default)s)")
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="output TSV, e.g. data/synthetic/x.tsv; with --days, a folder for day_<d>.tsv",
    )
    p.add_argument(
        "--days",
        type=int,
        default=0,
        help="write DAYS files OUT/day_0.tsv .. day_<DAYS-1>.tsv of --rows each, whose click "
        "model and id popularity drift by --drift a day (training.data.drift); 0: one file",
    )
    p.add_argument(
        "--drift",
        type=float,
        default=0.0,
        help="with --days: the fraction of the click model's variance redrawn and of the id "
        "popularity ranks reshuffled each day, in [0, 1] (0: the same model every day)",
    )
    p.add_argument(
        "--vocab",
        type=int,
        nargs="+",
        metavar="N",
        help="distinct ids per categorical feature: one value for all 26, or 26 values "
        "(default: a Criteo-like mix from 5 to 10000)",
    )
    p.add_argument(
        "--zipf", type=float, default=d.zipf, help="id frequency exponent (default %(default)s)"
    )
    p.add_argument(
        "--informative",
        type=int,
        default=d.informative_sparse,
        help="categorical features with a planted effect (default %(default)s)",
    )
    p.add_argument(
        "--ctr", type=float, default=d.target_ctr, help="target mean CTR (default %(default)s)"
    )
    p.add_argument("--chunk-rows", type=int, default=100_000, help="rows per generated block")
    p.add_argument(
        "--processes",
        type=int,
        default=0,
        help="processes sampling blocks (default 0: one per core; the bytes do not depend on it)",
    )
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: parse options, generate, print where the files went."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    vocab = list(DEFAULT_VOCAB) if args.vocab is None else args.vocab
    if len(vocab) == 1:
        vocab = vocab * NUM_SPARSE
    try:
        spec = SyntheticSpec(
            rows=args.rows,
            seed=args.seed,
            vocab_sizes=vocab,
            zipf=args.zipf,
            informative_sparse=args.informative,
            target_ctr=args.ctr,
        )
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    if args.days:
        return main_days(spec, args.days, args.drift, args.out, args.chunk_rows, args.no_progress)
    out = generate(spec, args.out, args.chunk_rows, not args.no_progress, processes=args.processes)
    seconds = time.perf_counter() - start
    print(
        f"{out} and {prob_sidecar(out)}: {spec.rows} rows in {seconds:.1f}s "
        f"({spec.rows / seconds:,.0f} rows/s)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
