"""What makes a reply a success for the load generator (kept apart from the locustfile, which
patches the process with gevent on import, so that tests can call it)."""

from __future__ import annotations

from typing import Any


class BadReply(Exception):
    """An OK status with a reply that cannot be right (counted as a failure, by reason)."""


def check_reply(request: Any, reply: Any) -> BadReply | None:
    """One finite probability in [0, 1] per example, and the model's name and version."""
    scores = list(getattr(reply, "scores", ()))
    expected = getattr(request, "num_examples", len(scores))
    if len(scores) != expected:
        return BadReply(f"{len(scores)} scores for {expected} examples")
    if not all(0.0 <= s <= 1.0 for s in scores):  # NaN fails both comparisons
        return BadReply("a score is not a probability in [0, 1]")
    if not getattr(reply, "model_name", "") or not getattr(reply, "model_version", ""):
        return BadReply("the reply names no model name or version")
    return None
