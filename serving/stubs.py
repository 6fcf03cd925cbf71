"""The generated gRPC modules of this project's API, imported in one place.

``make setup`` (``python -m serving.protos``) generates them into ``serving/_gen``; nothing
generates them at import time. When they are missing, importing this module (or anything that
uses it) fails with one line naming that command instead of a bare ``No module named``.

The KServe v2 stubs (``kserve_pb2``) are built in a descriptor pool of their own, so this
module and ``tritonclient.grpc`` import side by side. TorchServe's stubs are imported the same
way by ``serving.torchserve.client``, through :func:`generated`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from google.protobuf.descriptor import FileDescriptor
from google.protobuf.descriptor_pool import DescriptorPool

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
    from serving._gen.kserve import grpc_predict_v2_pb2 as kserve_pb2
    from serving._gen.kserve import grpc_predict_v2_pb2_grpc as kserve_pb2_grpc
    from serving._gen.recsys.v1 import ranker_pb2, ranker_pb2_grpc


def reflection_pool(*files: FileDescriptor) -> DescriptorPool:
    """One pool holding ``files`` and their imports, for server reflection: the KServe stubs
    live in a pool of their own (see ``serving.protos``), the other services in the default."""
    pool = DescriptorPool()
    added: set[str] = set()

    def add(fd: FileDescriptor) -> None:
        if fd.name in added:
            return
        for dep in fd.dependencies:
            add(dep)
        pool.AddSerializedFile(fd.serialized_pb)
        added.add(fd.name)

    for fd in files:
        add(fd)
    return pool


__all__ = [
    "MISSING",
    "StubsMissing",
    "generated",
    "kserve_pb2",
    "kserve_pb2_grpc",
    "ranker_pb2",
    "ranker_pb2_grpc",
    "reflection_pool",
]
