"""What a training run measures and records: read by people, plots and the continuous loop.

:mod:`~training.metrics.log` (AUC and NE over all ranks, the ``metrics.jsonl`` log),
:mod:`~training.metrics.evaluator` (held-out evaluation: when, and on which rows),
:mod:`~training.metrics.tb` (TensorBoard scalars), :mod:`~training.metrics.plot` (the learning
curves, ``python -m training.metrics.plot RUN``), :mod:`~training.metrics.monitor` (the best
evaluation, early stopping), :mod:`~training.metrics.baseline` (the hashed logistic regression
every run's final figures are set beside).
"""
