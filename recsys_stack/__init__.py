"""Pieces every stage shares: the config mechanism (:mod:`recsys_stack.config`, on top of
:mod:`recsys_stack.typed`) and free ports (:mod:`recsys_stack.net`), standard library only;
log-friendly progress bars (:mod:`recsys_stack.progress`, needs tqdm: training only); and the
one ROC AUC (:mod:`recsys_stack.metrics`, on numpy arrays or torch tensors: it imports only the
library of what it is given); the record of the data a model was trained on, and its fingerprint
check (:mod:`recsys_stack.datafile`, standard library only)."""
