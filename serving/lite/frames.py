"""The lite workers' local socket: length-prefixed frames on a Unix stream socket.

The gateway reaches lite workers on the same machine this way (``--backend lite:PATH``)
instead of gRPC: the same requests and answers as TorchServe's ``Predictions``, without two
Python gRPC stacks per call (at 100 examples x 4 callers they cost more CPU than everything but
the forward: docs/bench.md, "Close to the compute floor"). No torch here: the gateway imports it.

- The client's first frame is its ``authorization`` value (``Bearer <key>``, the key the worker
  wrote to its key file at start, as a TorchServe key): no answer when it is right; when it
  is not, PERMISSION_DENIED answers it and every request sent after it, and the worker closes
  the connection a second later.
- Then each request frame carries a serialized ``PredictionsRequest`` and its deadline
  (seconds since the epoch, both ends on one clock; 0 = none); each gets exactly one answer,
  in order: status OK and the prediction's bytes, or a gRPC status code and its details
  (UTF-8). A request whose deadline has passed when the worker gets to it is answered
  DEADLINE_EXCEEDED unscored: after a stall the worker does not spend its cores on calls
  nobody waits for (TorchServe scores them).
- A frame over :data:`MAX_FRAME` bytes ends the connection (RESOURCE_EXHAUSTED first).
"""

from __future__ import annotations

import struct
from typing import Any

SCHEME = "lite:"
"""A ``backend`` entry ``lite:PATH`` names a worker's socket."""
REQUEST = struct.Struct("<Id")
"""Payload bytes, deadline (epoch seconds, 0 = none); the hello frame's deadline is 0."""
REPLY = struct.Struct("<IB")
"""Payload bytes, gRPC status code (0 = OK)."""
MAX_FRAME = 256 << 20
MAX_PATH = 107
"""Longest Unix socket path Linux takes (``sun_path`` is 108 bytes with its NUL)."""


def check_path(path: str) -> str:
    """``path`` if a Unix socket can live there, else ValueError saying what to do."""
    if not path:
        raise ValueError(f"backend: '{SCHEME}' needs a socket path ({SCHEME}/run/lite/7200.sock)")
    if len(path.encode()) > MAX_PATH:
        raise ValueError(
            f"socket path {path} is {len(path.encode())} bytes; Unix sockets take {MAX_PATH} at "
            "most: use a shorter folder"
        )
    return path


class FrameTooLarge(ValueError):
    """A frame's header says more than :data:`MAX_FRAME` bytes."""


def cut(buf: bytearray, head: struct.Struct) -> tuple[tuple[Any, ...], bytes] | None:
    """The first whole frame in ``buf`` (``head``'s fields, the payload), removed from it;
    None until it has all arrived. Raises :class:`FrameTooLarge`."""
    if len(buf) < head.size:
        return None
    fields = head.unpack_from(buf)
    if fields[0] > MAX_FRAME:
        raise FrameTooLarge(f"frame of {fields[0]} bytes > {MAX_FRAME}")
    end = head.size + fields[0]
    if len(buf) < end:
        return None
    with memoryview(buf) as view:
        payload = bytes(view[head.size : end])
    del buf[:end]  # bytearray drops its head without moving the rest
    return fields, payload
