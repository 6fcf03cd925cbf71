"""The load tests run against the serving tests' stack fixture (tests/stack.py)."""

from tests.stack import stack

__all__ = ["stack"]
