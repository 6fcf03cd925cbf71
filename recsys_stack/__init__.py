"""Pieces every stage shares: the config mechanism (:mod:`recsys_stack.config`, on top of
:mod:`recsys_stack.typed`) and free ports (:mod:`recsys_stack.net`), standard library only; and
log-friendly progress bars (:mod:`recsys_stack.progress`, needs tqdm: training only)."""
