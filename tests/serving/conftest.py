"""Shared fixtures of the serving tests: TorchServe (+ gateway) on free ports (tests/stack.py)."""

from tests.stack import stack, torchserve

__all__ = ["stack", "torchserve"]
