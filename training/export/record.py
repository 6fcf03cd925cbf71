"""schema.json's ``data`` record: what the exported checkpoint trained on, and which rows it
never saw (:mod:`recsys_stack.datafile` describes the fields; serving/tools/evaldata.py reads
them for the defaults of ``make score``, ``make evaluate`` and ``make rollout``).

* a **batch run** (``make train``) never trains on its held-out rows, the last
  ``data.eval_fraction`` of its rows; its validation rows (their first part) chose its
  checkpoint and early stopping, so its unseen rows are the rest, its test split (a run from
  before the test split: all its held-out rows);
* a **continuous run** trains on every row of each file it consumes, so it has no held-out
  split; its unseen rows are a file given with ``--unseen-data`` (the loop passes the file that
  arrived after the checkpoint, before any model trained on it), and ``trained_files`` lists
  every file it trained on. Exported without one, it records none: the tools then refuse their
  default rows instead of scoring rows it trained on.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from recsys_stack import datafile
from training.errors import DataError

logger = logging.getLogger("training.export")


def data_record(cfg: Any, meta: dict[str, Any], unseen: Path | None = None) -> dict[str, Any]:
    """The ``data`` record of the checkpoint ``meta`` of config ``cfg``; ``unseen``: a file
    none of whose rows it trained on (module doc)."""
    from training.data.criteo import resolve_data_paths
    from training.data.first_run import synthetic_file

    info = meta.get("data", {})
    try:
        files = resolve_data_paths(cfg.data.path) if cfg.data.path else [synthetic_file(cfg.data)]
    except DataError:  # gone since training: recorded by path, the tools then refuse it
        files = [Path(cfg.data.path)]
    skipped = int(info.get("parse_report", {}).get("rows_bad", 0))
    rows = int(info.get("rows", 0))
    ledger = meta.get("continuous")
    # a continuous checkpoint trained every row of its files (older ones recorded no eval_rows)
    eval_rows = 0 if ledger else int(info.get("eval_rows", round(rows * cfg.data.eval_fraction)))
    test = None if ledger or "test_rows" not in info else int(info["test_rows"])
    data = datafile.record(files, rows, skipped, cfg.data.eval_fraction, eval_rows, test,
                           info.get("valid_fraction"))  # fmt: skip
    if ledger:
        data["trained_files"] = [
            {"name": f["file"], **f["content"]}
            for f in ledger.get("files", [])
            if f.get("content") and f.get("row", 0) > 0
        ]
    if unseen is not None:
        count, bad = file_rows(cfg, unseen)
        why = (
            "the file that came after its training data (--unseen-data; continuous training: "
            "scored before any model trained on it)"
        )
        data["unseen"] = datafile.unseen_entry([unseen], 0 if not bad else None, count, why)
        if bad:
            logger.warning("%s: %d malformed rows skipped; its unseen rows are counted from its "
                           "end", unseen, bad)  # fmt: skip
    elif ledger:
        logger.warning(
            "a continuous checkpoint exported without --unseen-data: it trained on every row "
            "of %s, so schema.json records no unseen rows (the tools' default rows are refused) "
            "and parity's AUC is on rows it trained on; pass --unseen-data FILE of a later file",
            ", ".join(f.name for f in files),
        )
    return data


def file_rows(cfg: Any, path: Path) -> tuple[int, int]:
    """(well-formed rows, malformed rows skipped) of ``path``, from its preprocessed cache
    (the parity rows built it, or the continuous loop before them: a lookup here)."""
    from training.data.binary import ensure_binary

    _, meta = ensure_binary(
        [path], Path(cfg.data.cache_dir), progress=False, rows_per_table=list(cfg.model.rows())
    )
    return int(meta.rows), int(meta.report.rows_bad)
