"""The generated gRPC modules of this project's API, imported in one place.

``make setup`` (``python -m serving.protos``) generates them into ``serving/_gen``; nothing
generates them at import time. When they are missing, importing this module (or anything that
uses it) fails with one line naming that command instead of a bare ``No module named``.

TorchServe's stubs are imported the same way by ``serving.torchserve.client``, through
:func:`generated`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

MISSING = "gRPC stubs are missing (serving/_gen): run `make setup` or `python -m serving.protos`"


class StubsMissing(ImportError):
    """``serving/_gen`` has not been generated (or not completely)."""


@contextlib.contextmanager
def generated() -> Iterator[None]:
    """Wrap imports of ``serving._gen...``: a missing module becomes :class:`StubsMissing`."""
    try:
        yield
    except ModuleNotFoundError as e:
        if (e.name or "").startswith("serving._gen"):
            raise StubsMissing(MISSING) from None
        raise


with generated():
    from serving._gen.recsys.v1 import ranker_pb2, ranker_pb2_grpc

__all__ = ["MISSING", "StubsMissing", "generated", "ranker_pb2", "ranker_pb2_grpc"]
