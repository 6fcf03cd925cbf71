"""Build a binary cache from Criteo TSV with worker processes, resumable and all-or-nothing.

``processes`` workers (default: one per core) parse line-aligned parts of the inputs
(:mod:`training.data.parts`); the result is the same bytes whatever their number. Parts are
kept in ``.<name>.parts/`` beside the cache until it is complete, so a run that was killed
resumes with the parts it had finished. The arrays are built in ``.<name>.tmp-<pid>/`` and
renamed into place; bad input, a vanished or truncated file, or a malformed-row policy breach
is one :class:`DataError` and leaves neither the cache nor its parts behind. A lock file per
cache (``.<name>.lock``) makes concurrent builders wait for each other instead of racing.
:func:`preprocess_share` parses one share of the parts and stops, so that a job array's tasks
parse on several hosts and the one :func:`preprocess` after them only merges.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
from collections.abc import Generator, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np

from recsys_stack import datafile
from recsys_stack.progress import progress as progress_bar
from training.data.criteo import OnBad, resolve_data_paths
from training.data.layout import FORMAT_VERSION, BinaryMeta, array_dtypes, id_hash_tag
from training.data.parts import (
    PART_BYTES,
    Job,
    Merger,
    Part,
    cpu_cores,
    finished,
    init_worker,
    kill_workers,
    parse_part,
    plan_parts,
)
from training.data.synthetic import prob_sidecar
from training.errors import DataError

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies

_HELD: dict[Path, int] = {}  # lock files this process holds, and their descriptors


def _stat(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def fingerprint(files: Sequence[Path]) -> list[dict[str, Any]]:
    """Identity of input files (and their prob sidecars) by content, the cache's key: each
    one's :func:`recsys_stack.datafile.fingerprint` (resolved path, bytes, sha256 of its first
    and last MiB). Not the mtime: ``cp -p``, ``rsync -t`` and ``tar x`` bring new bytes with an
    old size and mtime, and a plain copy of the same bytes needs no new cache."""
    out = []
    for f in files:
        sidecar = prob_sidecar(f)
        prob = datafile.fingerprint(sidecar) if sidecar.is_file() else None
        out.append({**datafile.fingerprint(f), "prob": prob})
    return out


def _load_sidecars(files: Sequence[Path]) -> list[np.ndarray] | None:
    """Every file's prob sidecar, or None unless all exist and load."""
    probs = []
    for f in files:
        sidecar = prob_sidecar(f)
        if not sidecar.is_file():
            return None
        try:
            probs.append(np.load(sidecar, mmap_mode="r"))
        except (ValueError, OSError, EOFError) as e:
            log.warning("ignoring unreadable prob sidecar %s: %s", sidecar, e)
            return None
    return probs


@contextlib.contextmanager
def locked(out_dir: Path) -> Iterator[None]:
    """Hold ``.<name>.lock`` beside ``out_dir`` (waiting for whoever holds it); removed after."""
    path = out_dir.absolute().parent / f".{out_dir.name}.lock"
    if path in _HELD:  # re-entrant
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process preprocessing into %s", out_dir)
            fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break  # not a lock file the previous holder removed after we opened it
        os.close(fd)
    _HELD[path] = fd
    try:
        yield
    finally:
        del _HELD[path]
        path.unlink(missing_ok=True)
        os.close(fd)


def _init_worker(parent: int) -> None:
    """A forked worker: let go of the parent's cache lock (so that a killed parent does not
    leave it held), die with the parent, one thread."""
    for fd in _HELD.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    if sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(1)
    init_worker()


def preprocess(
    paths: Sequence[Path | str],
    out_dir: Path,
    *,
    on_bad: OnBad = "skip",
    max_bad_rows: int = 1000,
    progress: bool = True,
    chunk_rows: int = 65536,
    rows_per_table: Sequence[int] | None = None,
    processes: int = 0,
    part_bytes: int = PART_BYTES,
) -> BinaryMeta:
    """Parse ``paths`` (files or directories) into ``out_dir``, replacing what was there.

    Ids are hashed into ``rows_per_table`` (kept raw without it). ``processes``: worker
    processes (0 = one per core); ``part_bytes``: size of the parts they take. ``prob.npy`` is
    written when every input has a ``<name>.prob.npy`` sidecar with one entry per data line;
    entries of skipped malformed rows are dropped with their rows. Raises :class:`DataError`
    per the ``on_bad`` policy, when an input changes meanwhile, or when no row is well-formed.
    """
    files = [p for path in paths for p in resolve_data_paths(path)]
    out_dir = Path(out_dir)
    tables = None if rows_per_table is None else tuple(int(r) for r in rows_per_table)
    with locked(out_dir):
        return _preprocess(
            files, out_dir, on_bad, max_bad_rows, progress, chunk_rows, tables, processes,
            part_bytes,
        )  # fmt: skip


def _preprocess(
    files: list[Path],
    out_dir: Path,
    on_bad: OnBad,
    max_bad_rows: int,
    progress: bool,
    chunk_rows: int,
    tables: tuple[int, ...] | None,
    processes: int,
    part_bytes: int,
) -> BinaryMeta:
    stats = [_stat(f) for f in files]  # before the content: a write after it moves the mtime
    for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):
        log.info("removing stale temporary directory %s", stale)
        shutil.rmtree(stale, ignore_errors=True)
    job, inputs, parts, dtypes, probs = _plan(
        files, out_dir, on_bad, max_bad_rows, chunk_rows, tables, part_bytes
    )
    work = job.work
    done = _resume(job, inputs, parts, dtypes)
    processes = min(processes or cpu_cores(), max(1, len(parts) - len(done)))
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    tmp.mkdir()
    t0 = time.perf_counter()
    try:
        merger = Merger(job, tmp, dtypes, probs)
        try:
            with contextlib.closing(_results(job, parts, done, processes, progress)) as results:
                for part, summary in results:
                    merger.add(part, summary)
            has_prob = merger.finish()
        finally:
            merger.close()
        _check_unchanged(files, inputs, stats)
        if merger.rows == 0:
            raise DataError(
                f"no well-formed rows in {', '.join(map(str, files))}: {merger.report.summary()}"
            )
        if probs is not None and not has_prob:
            log.warning("prob sidecars do not match the data line counts; not writing prob.npy")
        meta = BinaryMeta(
            rows=merger.rows,
            inputs=inputs,
            parse_report=merger.report.to_dict(),
            has_prob=has_prob,
            rows_per_table=None if tables is None else list(tables),
            id_hash=None if tables is None else id_hash_tag(),
            dtypes={k: str(v) for k, v in array_dtypes(tables, has_prob).items()},
        )
        (tmp / "meta.json").write_text(json.dumps(meta.to_dict(), indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except DataError:  # bad or changed input: parsing it again gives the same answer
        shutil.rmtree(work, ignore_errors=True)
        raise
    except BrokenProcessPool:
        raise DataError(
            f"a preprocessing worker died (killed, or out of memory?); the parts it finished "
            f"are kept in {work}: run again to resume"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    seconds = time.perf_counter() - t0
    log.info(
        "preprocessed %d rows into %s in %.1f s (%.0f rows/s, %d process%s, %d bytes/row; %s)",
        meta.rows, out_dir, seconds, meta.rows / max(seconds, 1e-9), processes,
        "" if processes == 1 else "es", meta.bytes_per_row(), merger.report.summary(),
    )  # fmt: skip
    return meta


def _plan(
    files: list[Path],
    out_dir: Path,
    on_bad: OnBad,
    max_bad_rows: int,
    chunk_rows: int,
    tables: tuple[int, ...] | None,
    part_bytes: int,
) -> tuple[Job, list[dict[str, Any]], list[Part], dict[str, np.dtype], list[np.ndarray] | None]:
    """What building ``out_dir`` from ``files`` takes: the job, the inputs' fingerprint, the
    parts, the arrays' dtypes and the prob sidecars (None unless every input has one)."""
    if on_bad not in ("skip", "fail"):
        raise ValueError(f"on_bad must be 'skip' or 'fail', got {on_bad!r}")
    inputs = fingerprint(files)
    probs = _load_sidecars(files)
    dtypes = array_dtypes(tables, probs is not None)
    job = Job(
        tuple(files), out_dir.parent / f".{out_dir.name}.parts", max(1, chunk_rows), on_bad,
        max_bad_rows, tables, str(dtypes["sparse"]), probs is not None,
    )  # fmt: skip
    return job, inputs, plan_parts(files, max(1, part_bytes)), dtypes, probs


def preprocess_share(
    paths: Sequence[Path | str],
    out_dir: Path,
    share: int,
    shares: int,
    *,
    on_bad: OnBad = "skip",
    max_bad_rows: int = 1000,
    progress: bool = True,
    chunk_rows: int = 65536,
    rows_per_table: Sequence[int] | None = None,
    processes: int = 0,
    part_bytes: int = PART_BYTES,
) -> tuple[int, int]:
    """Parse share ``share`` (0-based) of ``shares`` into ``out_dir``'s parts folder and stop
    there: part ``k`` of :func:`plan_parts` belongs to share ``k mod shares``. Run every share
    (processes or hosts sharing the folder, e.g. a job array), then :func:`preprocess` of the
    same arguments finds every part finished and only merges them: the same bytes as one
    process's cache. Shares run side by side; :func:`preprocess` must start after the last
    (a part being parsed is not one it may take). Returns (parts parsed here, parts in all).

    A part that breaks the malformed-row policy is left unfinished with a warning:
    :func:`preprocess` parses it again and raises the :class:`DataError` that names its rows.
    """
    if not 0 <= share < shares:
        raise ValueError(f"share {share} of {shares}: shares are numbered 0 .. {shares - 1}")
    files = [p for path in paths for p in resolve_data_paths(path)]
    out_dir = Path(out_dir)
    tables = None if rows_per_table is None else tuple(int(r) for r in rows_per_table)
    with locked(out_dir):  # the manifest: the first share writes it, the others find it
        job, inputs, parts, dtypes, _ = _plan(
            files, out_dir, on_bad, max_bad_rows, chunk_rows, tables, part_bytes
        )
        done = _resume(job, inputs, parts, dtypes)
    mine = [p for p in parts if p.index % shares == share and p.index not in done]
    processes = min(processes or cpu_cores(), max(1, len(mine)))
    with contextlib.closing(_results(job, mine, {}, processes, progress)) as results:
        for part, summary in results:
            if not summary["complete"]:
                log.warning(
                    "%s bytes %d-%d: more malformed rows than on_bad=%s, max_bad_rows=%d allow;"
                    " the step that merges the shares names them", job.files[part.file],
                    part.start, part.end, on_bad, max_bad_rows,
                )  # fmt: skip
    log.info("share %d of %d: %d of %d parts parsed into %s", share, shares, len(mine),
             len(parts), job.work)  # fmt: skip
    return len(mine), len(parts)


def _resume(
    job: Job, inputs: list[dict[str, Any]], parts: list[Part], dtypes: dict[str, np.dtype]
) -> dict[int, dict[str, Any]]:
    """Parts an earlier run of the same job finished; a different job's parts are dropped."""
    manifest = {
        "format_version": FORMAT_VERSION,
        "inputs": inputs,
        "rows_per_table": job.rows_per_table and list(job.rows_per_table),
        "id_hash": job.rows_per_table and id_hash_tag(),
        "dtypes": {k: str(v) for k, v in dtypes.items()},
        "parts": [[p.file, p.start, p.end] for p in parts],
    }
    path = job.work / "manifest.json"
    try:
        same = json.loads(path.read_text()) == json.loads(json.dumps(manifest))
    except (OSError, ValueError):
        same = False
    if not same:
        shutil.rmtree(job.work, ignore_errors=True)
        job.work.mkdir(parents=True)
        path.write_text(json.dumps(manifest))
        return {}
    done = {p.index: s for p in parts if (s := finished(job, p, dtypes)) is not None}
    if done:
        log.info("resuming: %d of %d parts are in %s already", len(done), len(parts), job.work)
    return done


def _results(
    job: Job, parts: list[Part], done: dict[int, dict[str, Any]], processes: int, progress: bool
) -> Generator[tuple[Part, dict[str, Any]], None, None]:
    """``(part, summary)`` in input order: resumed, parsed here, or by ``processes`` workers."""
    total = sum(p.end - p.start for p in parts)
    with progress_bar(
        total=total, unit="B", unit_scale=True, desc="parse", disable=not progress
    ) as bar:
        if processes <= 1:
            for p in parts:
                yield p, done[p.index] if p.index in done else parse_part(job, p)
                bar.update(p.end - p.start)
            return
        # fork: the workers start at once, with the modules already imported (spawn would
        # import torch again in each); they use numpy and one torch op, no threads.
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        with ProcessPoolExecutor(
            processes,
            mp_context=mp.get_context(method),
            initializer=_init_worker,
            initargs=(os.getpid(),),
        ) as pool:
            futures = {
                p.index: pool.submit(parse_part, job, p) for p in parts if p.index not in done
            }
            workers = list((pool._processes or {}).values())  # started by the submits
            try:
                for p in parts:
                    yield p, done[p.index] if p.index in done else futures[p.index].result()
                    bar.update(p.end - p.start)
            except BaseException:
                # The pool drops the queued parts itself: a future cancelled here while the
                # pool's thread failed those of a broken pool raised there (InvalidStateError)
                # before it stopped the workers, which went on writing parts after this error
                # (a resume at once found more parts done than a moment before). No part of a
                # failed run is written once its error is out: survivors are killed.
                pool.shutdown(wait=True, cancel_futures=True)
                kill_workers(workers)
                raise


def _check_unchanged(
    files: list[Path], inputs: list[dict[str, Any]], stats: list[dict[str, Any]]
) -> None:
    """Raise :class:`DataError` when an input was changed or removed while it was parsed: its
    size or mtime moved (a write meanwhile), or its content fingerprint did."""
    for path, before, stat in zip(files, inputs, stats, strict=True):
        try:
            now_stat, now = _stat(path), fingerprint([path])[0]
        except FileNotFoundError:
            raise DataError(f"{path}: vanished during preprocessing; nothing was cached") from None
        if now_stat != stat or now != before:
            raise DataError(
                f"{path}: changed during preprocessing (size {stat['size']} -> "
                f"{now_stat['size']}); nothing was cached: run again once it is complete"
            )
