"""The table rows the loop's passes may have changed since the state that serves: what a delta
compares (``training.export.delta.changed_among``) instead of every row of every table.

A fused optimizer (fbgemm's row-wise AdaGrad, SGD) moves only the rows a batch looks up, so
the rows that can differ between the checkpoint a delta is made of and the state the workers
serve (the default's export with its chain over it) are those the passes since that state
trained on. Every file's rows (and those carried into it) are added before its pass: a
superset of the rows its pass trains (rows carried out are added again with the next file),
never fewer. Each table's rows are a flag per row (1 byte a row: 34 MB at the criteo-kaggle
shape), so adding a file costs one scatter per table and asking costs one scan.

The set is only good against the state it started from: it is keyed by the deltas folder of
the served version and the last file of its chain. It (re)starts at each publish that
changes what serves (a full export: its own folder, an empty chain; a promoted delta: that
delta), and a refused publish leaves it growing. Asked for another state (the pointer moved
under it, a run that never saw the passes since) it answers None: the delta compares every
row, as without it. It is kept in ``RUN/touched.npz`` (a bit a row, with its state and the
step it started at), written as each file is added, before its pass: a loop restarted at
any checkpoint after that step finds a superset of what its passes trained; one resumed
from a checkpoint before it cannot use it (rows it trained since were reset) and starts none.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from recsys_model.features import hash_ids
from training.data.loader import Arrays, Joined

State = tuple[str, str]  # (the deltas folder of the served version, its chain's last file)


def chain_end(folder: Path, chain: Sequence[dict[str, Any]]) -> State:
    return str(folder), str(chain[-1]["file"]) if chain else ""


def table_rows(arrays: Arrays, rows_per_table: Sequence[int]) -> list[np.ndarray]:
    """Each table's rows that ``arrays``' ids look up (missing ids dropped), hashed for the
    tables as the loader hashes them when the cache holds raw ids."""
    sparse = np.asarray(arrays.sparse)
    out = []
    for t, n in enumerate(rows_per_table):
        ids = sparse[:, t]
        ids = ids[ids >= 0].astype(np.int64)
        if arrays.hashed_for is None:  # raw ids: the loader's own hash
            ids = hash_ids(torch.from_numpy(ids), torch.tensor(n)).numpy()
        out.append(ids)
    return out


class Touched:
    """Rows each table may have changed since :attr:`state` (module doc), kept in ``path``."""

    def __init__(
        self, path: Path, rows_per_table: Sequence[int], step: int, enabled: bool = True
    ) -> None:
        self.path, self.rows, self.enabled = path, [int(n) for n in rows_per_table], enabled
        self.flags: list[np.ndarray] | None = None
        self.state: State | None = None
        self.step = 0
        if not enabled:
            return  # (no deltas, or not rank 0): every method a no-op
        try:
            with np.load(path) as z:
                state, since = (str(z["folder"]), str(z["last"])), int(z["step"])
                if z["rows"].tolist() != self.rows:
                    return  # another model's tables
                flags = [np.unpackbits(z[f"t{t}"], count=n).astype(bool)
                         for t, n in enumerate(self.rows)]  # fmt: skip
        except (OSError, KeyError, ValueError):
            return  # none yet, another shape, or unreadable: every row is compared
        if since <= step:
            self.flags, self.state, self.step = flags, state, since

    def restart(self, state: State, step: int) -> None:
        """What serves is ``state``, the model at ``step``: nothing changed since."""
        if not self.enabled:
            return
        if self.flags is None:
            self.flags = [np.zeros(n, dtype=bool) for n in self.rows]
        else:
            for f in self.flags:
                f.fill(False)
        self.state, self.step = state, step
        self.save()

    def save(self) -> None:
        if self.flags is None or self.state is None:
            return
        tmp = self.path.with_suffix(".tmp.npz")
        arrays: dict[str, Any] = {f"t{t}": np.packbits(f) for t, f in enumerate(self.flags)}
        with open(tmp, "wb") as f:  # a file object: np.savez names it exactly so
            np.savez(f, folder=self.state[0], last=self.state[1], step=self.step,
                     rows=np.asarray(self.rows), **arrays)  # fmt: skip
        tmp.replace(self.path)

    def add(self, *parts: Arrays | Joined | None) -> None:
        """Rows a pass over ``parts`` may train (a no-op while no state is known)."""
        if self.flags is None:
            return
        for part in parts:
            for arrays in (part.head, part.tail) if isinstance(part, Joined) else (part,):
                if arrays is None:
                    continue
                for flags, ids in zip(self.flags, table_rows(arrays, self.rows), strict=True):
                    flags[ids] = True
        self.save()

    def since(self, state: State) -> list[np.ndarray] | None:
        """Each table's sorted rows touched since ``state``; None when this set is not of it."""
        if self.flags is None or self.state != state:
            return None
        return [np.flatnonzero(f) for f in self.flags]
