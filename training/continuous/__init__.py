"""Keep the model fresh: continuous training on arriving click logs (``make continuous``).

:mod:`~training.continuous.config` (the command line: the training config + ``[continuous]``),
:mod:`~training.continuous.inbox` (which files are read, rejection, the ledger of what was
consumed), :mod:`~training.continuous.file_loop` (progressive validation, one pass of training and
checkpoints per file), :mod:`~training.continuous.publish` (export and evaluated rollout).
"""
