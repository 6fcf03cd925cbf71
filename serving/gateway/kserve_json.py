"""KServe v2's HTTP request body: JSON tensors and Triton's binary tensor extension.

An infer request is a JSON object (``id``, ``parameters``, ``inputs``, ``outputs``); each
input has ``name``, ``datatype``, ``shape`` and either ``data`` (numbers, flat or nested,
row-major) or a ``binary_data_size`` parameter: then its little-endian bytes follow the JSON
header, whose length the ``Inference-Header-Content-Length`` header gives, in input order.
:class:`Infer` parses it into :class:`serving.gateway.kserve.Sent` tensors, which
:func:`serving.gateway.kserve.decode_tensors` decodes like gRPC's (:data:`JSON` is how the
JSON form holds values). Everything malformed is :class:`InvalidRequest`, one line.

JSON is parsed holding the GIL, so a body is bounded before and while it is parsed: at most
:func:`max_lists` ``[`` (tensors' ``data`` flat or nested by their shape: 4 MiB of
``[[],[],...]`` took 0.45 s to parse) and :data:`MAX_OBJECTS` objects (4 MiB of
``[{},{},...]`` took 0.1 s and 100 MB, 8 clients of it a p99 of 1 s: the parse now stops at
the object past the bound), no ``NaN``/``Infinity``, nesting Python's parser can follow (past
it, RecursionError was a 500). Off the event loop, one body is parsed at a time, and
:class:`Decodes` refuses calls past a small queue with RESOURCE_EXHAUSTED at once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import numpy as np

from serving.gateway import metrics
from serving.gateway.errors import ScoreError
from serving.gateway.kserve import INPUTS, Form, Model, Sent, Tensor, check_count
from serving.gateway.kserve import decode_tensors as decode
from serving.gateway.validate import InvalidRequest, clip

if TYPE_CHECKING:
    from serving.gateway.coalesce import Arrays
    from serving.gateway.validate import Limits, Schema

T = TypeVar("T")
HEADER_LENGTH = "Inference-Header-Content-Length"
# digits of a header length worth reading (a body is at most limits.max_request_bytes)
HEADER_DIGITS = 12
# a request's objects: itself, its parameters, each input and output and their parameters
# (2 + 4 x 3 = 14); twice that, for parameters a client adds that nothing reads
MAX_OBJECTS = 2 * (2 + 4 * len(INPUTS))
# JSON bodies waiting to be parsed off the event loop, in bodies of limits.max_request_bytes
QUEUED_BODIES = 4


class JsonForm(Form):
    """KServe v2 JSON ``data``: a list of numbers, flat or nested (row-major).

    Checked to hold numbers before numpy sees it: ``np.asarray`` made 40 KB of
    ``["x"*10000, "", "", ...]`` a 400 MB array of strings (a 4 MiB body, gigabytes). The
    check is ``sum()`` over the list (its rows): C speed, TypeError on anything that is no
    number, and an int when every value is an integer. JSON's true and false count as 1 and 0
    there, as in Python. Then numpy converts to the input's dtype in one step."""

    typed = "data"
    raw = "binary data"

    def where(self, spec: Tensor) -> str:
        return "data"

    def array(self, values: Any, spec: Tensor) -> np.ndarray:
        name, dtype = spec.name, np.dtype(spec.dtype)
        if not isinstance(values, list):
            raise InvalidRequest(f"input '{name}': data must be a list of numbers")
        try:
            total = sum(map(sum, values)) if values and type(values[0]) is list else sum(values)
        except (TypeError, OverflowError):  # a value that is no number, or ragged nesting
            raise InvalidRequest(
                f"input '{name}': data holds {_non_number(values)}; numbers only, flat or "
                f"nested as its shape"
            ) from None
        if dtype.kind != "f" and type(total) is float:
            raise InvalidRequest(
                f"input '{name}': data holds float values; the model takes {spec.datatype}"
            )
        try:
            a = np.asarray(values, dtype=dtype)
        except OverflowError:  # ints past the dtype's range (numpy 2 raises, never wraps)
            raise InvalidRequest(
                f"input '{name}': data out of the range of {spec.datatype}"
            ) from None
        except (ValueError, TypeError):  # rows of different lengths
            raise InvalidRequest(
                f"input '{name}': data is not a list of numbers of one shape"
            ) from None
        return a.reshape(-1)


def _non_number(values: list[Any]) -> str:
    """What in ``values`` (flat, or rows) is no number, in words (the first one found)."""
    nested = type(values[0]) is list
    for row in values if nested else [values]:
        if type(row) is not list:
            return "rows and numbers mixed"
        for v in row:
            if type(v) in (int, float, bool):
                continue
            if type(v) is list:
                return "lists nested deeper than two" if nested else "numbers and lists mixed"
            names = {"str": "str values", "NoneType": "null", "dict": "objects"}
            return names.get(type(v).__name__, f"{type(v).__name__} values")
    return "numbers too large to add up"  # a float and an int past 1e308


JSON = JsonForm()


def _get(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = doc.get(key, default)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise InvalidRequest(f"'{key}': {type(value).__name__}, expected {_kinds(kind)}")
    return value


def _kinds(kind: type | tuple[type, ...]) -> str:
    names = {"dict": "an object", "list": "a list", "str": "a string", "int": "an integer",
             "float": "a number", "bool": "true or false"}  # fmt: skip
    return " or ".join(names[k.__name__] for k in (kind if isinstance(kind, tuple) else (kind,)))


def max_lists(schema: Schema, limits: Limits) -> int:
    """The most ``[`` a request's JSON needs: ``inputs``, ``outputs``, three shapes, and the
    data nested by its shape (``dense`` [B, D]: B + 1, ``lengths`` [F, B]: F + 1,
    ``values``: 1); 16 to spare."""
    return limits.max_examples + len(schema.sparse) + 24


def json_bytes(body: bytes, header_length: str | None) -> int:
    """How much of ``body`` is JSON, as ``header_length`` (the header's value, None = all
    of it) says; -1 when it is not a length within the body."""
    if header_length is None:
        return len(body)
    text = header_length.strip()  # digits 0-9 only ('²'.isdigit()), and few of them
    n = int(text) if text.isascii() and text.isdigit() and len(text) <= HEADER_DIGITS else -1
    return n if n <= len(body) else -1


def split(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """``body`` -> (JSON header, binary data) (:func:`json_bytes`)."""
    if header_length is None:
        return body, b""
    n = json_bytes(body, header_length)
    if n < 0:
        raise InvalidRequest(
            f"{HEADER_LENGTH}: {clip(header_length)}, the body has {len(body)} bytes"
        )
    return body[:n], body[n:]


def _constant(name: str) -> Any:
    raise InvalidRequest(f"the request holds {name}: JSON numbers only (finite)")


def parse(head: bytes, lists: int | None = None) -> Any:
    """The JSON document ``head``, bounded (module docstring): at most ``lists`` ``[``
    (None = any) and :data:`MAX_OBJECTS` objects, no NaN or Infinity."""
    if lists is not None and (n := head.count(b"[")) > lists:
        raise InvalidRequest(
            f"the request holds {n} '[': at most {lists} (tensors' data is flat, or nested as "
            "its shape, within limits.max_examples)"
        )
    objects = 0

    def counted(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal objects
        objects += 1
        if objects > MAX_OBJECTS:  # stops the parse here: its work is bounded
            raise InvalidRequest(
                f"the request holds over {MAX_OBJECTS} JSON objects: a request is an object, "
                "its parameters, and inputs and outputs with theirs; data holds numbers"
            )
        return dict(pairs)

    try:
        return json.loads(head, object_pairs_hook=counted, parse_constant=_constant)
    except InvalidRequest:
        raise
    except RecursionError:
        raise InvalidRequest("the request's JSON nests too deep (data: numbers, nested as "
                             "its shape)") from None  # fmt: skip
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"the request is not JSON: {e}") from None


class Infer:
    """An infer request's JSON header (and binary data) parsed: the tensors as sent, the
    outputs asked for and how they go back. ``lists``: :func:`max_lists` (None = any)."""

    def __init__(self, body: bytes, header_length: str | None, lists: int | None = None) -> None:
        head, binary = split(body, header_length)
        doc = parse(head, lists)
        if not isinstance(doc, dict):
            raise InvalidRequest("the request must be a JSON object with 'inputs'")
        self.id: str = _get(doc, "id", str, "")
        params = _get(doc, "parameters", dict, {})
        self.binary = _get(params, "binary_data_output", bool, False)
        timeout = _get(params, "timeout", (int, float), 0)
        self.time_remaining = timeout / 1e6 if timeout > 0 else None  # Triton: microseconds
        outputs = _get(doc, "outputs", list, [])
        check_count("outputs", len(outputs))
        self.outputs = []
        for out in outputs:
            if not isinstance(out, dict):
                raise InvalidRequest("outputs: each is an object with a 'name'")
            self.outputs.append(_get(out, "name", str, ""))
            self.binary |= _get(_get(out, "parameters", dict, {}), "binary_data", bool, False)
        inputs = _get(doc, "inputs", list, [])
        check_count("inputs", len(inputs))
        self.sent, at = [], 0
        for t in inputs:
            if not isinstance(t, dict):
                raise InvalidRequest("inputs: each is an object with name, datatype, shape")
            name = _get(t, "name", str, "")
            shape = _get(t, "shape", list, [])
            if not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
                raise InvalidRequest(f"input {clip(name)}: shape must be a list of integers")
            size = _get(_get(t, "parameters", dict, {}), "binary_data_size", int, -1)
            raw = None
            if size >= 0:
                if size > len(binary) - at:
                    raise InvalidRequest(
                        f"input {clip(name)}: binary_data_size {size}, but {len(binary) - at} "
                        f"bytes of binary data are left ({HEADER_LENGTH} says where they start)"
                    )
                raw, at = binary[at : at + size], at + size
            self.sent.append(Sent(name, _get(t, "datatype", str, ""), shape, raw, t.get("data")))
        if at != len(binary):
            raise InvalidRequest(
                f"{len(binary) - at} bytes of binary data no input's binary_data_size claims"
            )


def decoded(model: Model, body: bytes, header_length: str | None) -> tuple[Arrays, Infer]:
    """The checked arrays of an infer request's ``body``, and the request."""
    infer = Infer(body, header_length, max_lists(model.schema, model.ranker.cfg.limits))
    return model.arrays(lambda: decode(infer.sent, JSON), infer.outputs, len(body)), infer


class Decodes:
    """JSON bodies parsed off the event loop: one at a time (the gateway has one offload
    thread, and a parse holds the GIL), with at most ``queued`` bytes of bodies waiting;
    a call past that is refused at once (RESOURCE_EXHAUSTED: HTTP 429). Bytes, not calls:
    parsing takes time in proportion to them, so the queue's wait is bounded either way."""

    def __init__(self) -> None:
        self.waiting = 0  # bytes of the bodies waiting for their turn
        self._loop: asyncio.AbstractEventLoop | None = None
        self._turn = asyncio.Semaphore(1)

    async def run(self, parse: Callable[[], T], size: int, queued: int) -> T:
        """``parse()`` in the offload thread, its turn come (``size``: its body's bytes)."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a semaphore binds to the loop it first waits on
            self._loop, self._turn, self.waiting = loop, asyncio.Semaphore(1), 0
        if self._turn.locked() and self.waiting + size > queued:
            metrics.rejected("overload")
            raise ScoreError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"overloaded: {self.waiting + size} bytes of JSON waiting to be parsed, the "
                f"queue takes {queued}; retry with backoff (binary tensor data skips JSON)",
            )
        self.waiting += size
        try:
            async with self._turn:
                self.waiting -= size
                size = 0
                return await asyncio.to_thread(parse)
        finally:
            self.waiting -= size  # cancelled while waiting


DECODES = Decodes()
"""The process's (it has one offload thread)."""
