"""``make sweep``: search a preset's hyperparameters with Optuna on the validation AUC.

Each trial is a real training run (``python -m training.train`` in ``<sweep>/trial_NNNN``) whose
evaluation records the sweep reads as they appear, so that the pruner can stop a bad trial
early; the study lives in Optuna storage (a journal file in the sweep folder by default, or any
Optuna URL), so that the same command continues it and several processes, on one machine or
many, share it. The pieces: :mod:`~training.sweep.options` (the command line, torch-free),
:mod:`~training.sweep.space` (what is searched), :mod:`~training.sweep.trial` (one run and its
objective), :mod:`~training.sweep.study` (the loop: budget, parallel trials, resume),
:mod:`~training.sweep.report` (table, plot) and :mod:`~training.sweep.best` (the best config as
a TOML the trainer takes).
"""
