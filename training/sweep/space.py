"""What a sweep searches: the preset's key hyperparameters, around the preset's own values.

Every choice includes the preset's value (a size factor of 1, its epochs, its weight decay),
so that the preset itself is a point of the space: the sweep's first trial (``default``).
A trial's values become training overrides (``optim.dense_lr=0.0123``); the sizes that must
agree follow each other (the bottom MLP ends at the embedding dim), and the evaluations stay at
the same rows seen whatever the batch size (``train.eval_every`` scales with it), so that the
pruner compares trials at the same point of their training.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from training.config import Config
from training.sweep.options import SpaceConfig


class Suggests(Protocol):
    """What :func:`suggest` asks of a trial (an ``optuna.Trial``; a dict-backed stand-in in
    :func:`default_params`)."""

    def suggest_float(self, name: str, low: float, high: float, *, log: bool = False) -> float: ...
    def suggest_int(self, name: str, low: int, high: int) -> int: ...
    def suggest_categorical(self, name: str, choices: Any) -> Any: ...


def _scaled(value: int, factor: float) -> int:
    return max(1, round(value * factor))


def _factors(space: SpaceConfig) -> list[float]:
    return sorted({float(f) for f in space.size_factors} | {1.0})


def suggest(trial: Suggests, base: Config, space: SpaceConfig) -> dict[str, Any]:
    """The trial's training values, by config key (``{"optim.dense_lr": 0.0123, ...}``)."""
    want, out = set(space.params), dict[str, Any]()
    m, o, t = base.model, base.optim, base.train
    for name in ("embedding_lr", "dense_lr"):
        if name in want:
            lr = getattr(o, name)
            out[f"optim.{name}"] = trial.suggest_float(
                name, lr / space.lr_factor, lr * space.lr_factor, log=True
            )
    dim = m.embedding_dim
    if "embedding_dim" in want:
        dims = sorted({_scaled(m.embedding_dim, f) for f in _factors(space)})
        dim = trial.suggest_categorical("embedding_dim", dims)
        out["model.embedding_dim"] = dim
    dense_x = (
        trial.suggest_categorical("dense_arch_x", _factors(space)) if "dense_arch" in want else 1.0
    )
    if dim != m.embedding_dim or dense_x != 1.0:  # the bottom MLP's output joins the embeddings
        out["model.dense_arch"] = [_scaled(s, dense_x) for s in m.dense_arch[:-1]] + [dim]
    if "over_arch" in want:
        over_x = trial.suggest_categorical("over_arch_x", _factors(space))
        out["model.over_arch"] = [_scaled(s, over_x) for s in m.over_arch[:-1]] + [1]
    if "num_embeddings" in want:
        if isinstance(m.num_embeddings, int):
            rows = sorted({_scaled(m.num_embeddings, f) for f in _factors(space)})
            out["model.num_embeddings"] = trial.suggest_categorical("num_embeddings", rows)
        else:  # one size per table (the data's cardinalities): all scaled alike
            rows_x = trial.suggest_categorical("num_embeddings_x", _factors(space))
            out["model.num_embeddings"] = [_scaled(r, rows_x) for r in m.num_embeddings]
    if "batch_size" in want:
        batches = sorted({_scaled(t.batch_size, f) for f in _factors(space)})
        batch = trial.suggest_categorical("batch_size", batches)
        out["train.batch_size"] = batch
        if t.eval_every:  # evaluations at the same rows seen as the preset's
            out["train.eval_every"] = max(1, round(t.eval_every * t.batch_size / batch))
    if "dense_weight_decay" in want:
        decays = sorted({float(w) for w in space.weight_decays} | {o.dense_weight_decay})
        out["optim.dense_weight_decay"] = trial.suggest_categorical("dense_weight_decay", decays)
    if "epochs" in want:
        out["train.epochs"] = trial.suggest_int("epochs", 1, max(space.max_epochs, t.epochs))
    return out


class _Recorder:
    """A trial that answers every question with the preset's own value, and records it."""

    def __init__(self, base: Config) -> None:
        m, o, t = base.model, base.optim, base.train
        self.values: dict[str, Any] = {
            "embedding_lr": o.embedding_lr, "dense_lr": o.dense_lr,
            "embedding_dim": m.embedding_dim, "num_embeddings": m.num_embeddings,
            "batch_size": t.batch_size, "dense_weight_decay": o.dense_weight_decay,
            "epochs": t.epochs,
        }  # fmt: skip
        self.params: dict[str, Any] = {}

    def _take(self, name: str) -> Any:
        self.params[name] = self.values.get(name, 1.0)  # factors: 1.0
        return self.params[name]

    def suggest_float(self, name: str, low: float, high: float, *, log: bool = False) -> float:
        return float(self._take(name))

    def suggest_int(self, name: str, low: int, high: int) -> int:
        return int(self._take(name))

    def suggest_categorical(self, name: str, choices: Any) -> Any:
        return self._take(name)


def default_params(base: Config, space: SpaceConfig) -> dict[str, Any]:
    """The Optuna params that stand for the preset itself (``study.enqueue_trial``)."""
    recorder = _Recorder(base)
    suggest(recorder, base, space)
    return recorder.params


def overrides(values: dict[str, Any]) -> list[str]:
    """``key=value`` training overrides (TOML values) of :func:`suggest`'s dict."""
    return [f"{key}={json.dumps(value)}" for key, value in values.items()]
