"""Checkpoints: what a run saves, when, and what a stopped run says survived.

:mod:`~training.checkpoint.store` is the on-disk format (DCP folders, ``latest``, the
:class:`~training.checkpoint.store.Progress` the data stream resumes from), with the row-wise
optimizer state resharded by :mod:`~training.checkpoint.rowwise`;
:mod:`~training.checkpoint.checkpointer` is the schedule and the resume the training loops call.
A stop reports the checkpoint a relaunch resumes from: Ctrl-C in
:mod:`~training.checkpoint.interrupt`, a lost peer in :mod:`~training.checkpoint.peers`.
"""
