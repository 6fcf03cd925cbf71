"""Pieces every stage shares and that need only the standard library: the config mechanism
(:mod:`recsys_stack.config`), free ports (:mod:`recsys_stack.net`) and log-friendly progress
bars (:mod:`recsys_stack.progress`)."""
