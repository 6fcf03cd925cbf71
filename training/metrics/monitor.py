"""The best evaluation so far, and when to stop: Lightning's ``ModelCheckpoint(monitor=...)``
and ``EarlyStopping(patience, min_delta)`` for :func:`training.step_loop.run_schedule`.

:class:`Monitor` reads one figure of each evaluation record, ``train.monitor`` (``auc``: higher
is better; ``ne``: lower), on the same validation rows every time: periodic evaluations
score the first ``train.eval_rows`` rows of the validation split, and the final one, on all of
them, also carries its figure on those rows (``valid.subset_auc``, ``valid.subset_ne``), which
is what is compared; the final record's own figures are the test rows', never compared.
An improvement, however small, makes a record the best (the schedule then saves a checkpoint
of it and names it in ``checkpoints/best``); early stopping counts the evaluations since the
last improvement of at least ``train.early_stop_min_delta`` and stops after
``train.early_stop_patience`` of them. Its state goes into every checkpoint's ``meta.json``
(``monitor``) so a resumed run goes on comparing where it left off.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from training.config import TrainConfig

STATE = ("best_value", "best_step", "reference", "waited")


@dataclass
class Monitor:
    """Best value and step of ``metric``; early stopping's reference and patience count."""

    metric: str = "auc"
    patience: int = 0
    min_delta: float = 0.0
    keep_best: bool = True  # the schedule saves each new best and names it checkpoints/best
    best_value: float | None = None
    best_step: int | None = None
    reference: float | None = None  # early stopping's best: moved only by > min_delta
    waited: int = 0  # evaluations since the reference last moved
    stop_reason: str = ""

    @classmethod
    def from_config(cls, t: TrainConfig) -> Monitor:
        return cls(t.monitor, t.early_stop_patience, t.early_stop_min_delta, t.keep_best)

    def value(self, record: dict[str, Any]) -> float | None:
        """The record's figure on the periodic evaluations' rows, of the validation split
        (a final record's ``valid``); None: not a number."""
        src = record.get("valid") or record
        v = src.get(f"subset_{self.metric}", src.get(self.metric))
        return float(v) if isinstance(v, int | float) and math.isfinite(v) else None

    def _better(self, a: float, b: float, delta: float = 0.0) -> bool:
        return a > b + delta if self.metric == "auc" else a < b - delta

    def update(self, record: dict[str, Any], final: bool = False) -> bool:
        """Count ``record`` in; True when it is the new best. Sets :attr:`stop_reason` when
        early stopping's patience has run out; a ``final`` record (there is nothing left to
        stop) can be the best but does not count for early stopping."""
        v = self.value(record)
        improved = v is not None and (self.best_value is None or self._better(v, self.best_value))
        if improved:
            self.best_value, self.best_step = v, int(record["step"])
        if final:
            return improved
        if v is not None and (
            self.reference is None or self._better(v, self.reference, self.min_delta)
        ):
            self.reference, self.waited = v, 0
        else:
            self.waited += 1
        if self.patience and self.waited >= self.patience and not self.stop_reason:
            best = (
                "no evaluation gave a number"
                if self.best_value is None
                else f"the best was {self.best_value:.4f}, at step {self.best_step}"
            )
            self.stop_reason = (
                f"early stopping at step {record['step']}: {self.waited} evaluation"
                f"{'s' if self.waited > 1 else ''} in a row without eval "
                f"{self.metric.upper()} bettering {self.reference or math.nan:.4f} by more than "
                f"{self.min_delta:g} (train.early_stop_patience = {self.patience}, "
                f"train.early_stop_min_delta); {best}"
            )
        return improved

    @property
    def should_stop(self) -> bool:
        return bool(self.stop_reason)

    def summary(self, checkpoint: str) -> dict[str, Any]:
        """What the final record says of the best: ``{"step", "monitor", "value", "checkpoint"}``."""
        return {"step": self.best_step, "monitor": self.metric, "value": self.best_value,
                "checkpoint": checkpoint}  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint records (meta.json's ``monitor``), with the metric it is of."""
        state = {k: v for k, v in asdict(self).items() if k in STATE}
        return {"metric": self.metric, **state}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Take a checkpoint's state; one of another metric (or none) starts afresh."""
        self.reset()
        if state and state.get("metric") == self.metric:
            for key in STATE:
                setattr(self, key, state.get(key, getattr(self, key)))

    def reset(self) -> None:
        self.best_value = self.best_step = self.reference = None
        self.waited, self.stop_reason = 0, ""
