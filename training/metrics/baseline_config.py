"""The baselines' config section, ``[baseline]`` (:class:`training.config.Config` holds it).

Apart from :mod:`training.config` so that the search's and the trees' keys do not crowd the
trainer's; the same mechanism (a docstring per field is its ``--help``), imported there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from training.errors import ConfigError


@dataclass
class BaselineConfig:
    enabled: bool = True
    """After the last step, fit an L2 logistic regression on hashed features of the model's
    training rows, its penalty chosen on the validation rows, report it on the test rows
    beside the model (a paired test), and warn when the model does not beat it."""
    hash_bits: int = 20
    """Its weights: 2^hash_bits, each (field, value) pair hashed into one (dense: log buckets)."""
    l2: list[float] = field(default_factory=lambda: [100.0, 30.0, 10.0, 3.0, 1.0, 0.3, 0.1])
    """L2 penalties the linear baseline tries, on the validation rows, strongest first: each
    fit minimizes the summed log loss plus l2 * |w|^2 / 2 (scikit-learn's C = 1 / l2), and the
    search stops at the first that scores worse than the one before."""
    max_rows: int = 200_000
    """The linear baseline fits on the first max_rows of the model's training rows (all of
    them when fewer; baseline_train_rows says how many): it solves its problem to the end on
    each pass over them, so its cost grows with these rows times the penalties tried."""
    learning_rate: float = 0.1
    """The continuous loop's baseline (fitted online, file by file as the model trains, by
    AdaGrad; no search): its learning rate."""
    trees: bool = False
    """Also fit gradient-boosted trees (LightGBM) on the training rows, stopped early on the
    validation rows, reported on the test rows beside the model (trees_* in the record)."""
    trees_rounds: int = 1000
    """The trees' most boosting rounds (early stopping on validation usually ends sooner)."""
    trees_leaves: int = 31
    """Leaves per tree."""
    trees_learning_rate: float = 0.05
    """The trees' shrinkage per round."""
    trees_min_count: int = 20
    """A categorical id seen on fewer training rows shares one category with the other rare
    and unseen ids of its field (LightGBM splits on the frequent ones)."""

    def check(self) -> None:
        """Raise ConfigError naming the first key out of its range."""
        for key, ok, want in [
            ("hash_bits", 10 <= self.hash_bits <= 26, "in [10, 26]"),
            ("l2", bool(self.l2) and min(self.l2) > 0, "one or more values > 0"),
            ("max_rows", self.max_rows >= 1, ">= 1"),
            ("learning_rate", self.learning_rate > 0, "> 0"),
            ("trees_rounds", self.trees_rounds >= 1, ">= 1"),
            ("trees_leaves", self.trees_leaves >= 2, ">= 2"),
            ("trees_learning_rate", self.trees_learning_rate > 0, "> 0"),
            ("trees_min_count", self.trees_min_count >= 1, ">= 1"),
        ]:  # fmt: skip
            if not ok:
                raise ConfigError(f"baseline.{key} = {getattr(self, key)}: must be {want}")
