"""KServe v2's HTTP request body: JSON tensors and Triton's binary tensor extension.

An infer request is a JSON object (``id``, ``parameters``, ``inputs``, ``outputs``); each
input has ``name``, ``datatype``, ``shape`` and either ``data`` (numbers, flat or nested,
row-major) or a ``binary_data_size`` parameter: then its little-endian bytes follow the JSON
header, whose length the ``Inference-Header-Content-Length`` header gives, in input order.
:class:`Infer` parses it into :class:`serving.gateway.kserve.Sent` tensors, which
:func:`serving.gateway.kserve.decode_tensors` decodes like gRPC's (:data:`JSON` is how the
JSON form holds values). Everything malformed is :class:`InvalidRequest`, one line.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np

from serving.gateway.kserve import Form, Model, Sent, Tensor, check_count
from serving.gateway.kserve import decode_tensors as decode
from serving.gateway.validate import InvalidRequest, clip

if TYPE_CHECKING:
    from serving.gateway.coalesce import Arrays

HEADER_LENGTH = "Inference-Header-Content-Length"


class JsonForm(Form):
    """KServe v2 JSON ``data``: a list of numbers, flat or nested (row-major)."""

    typed = "data"
    raw = "binary data"

    def where(self, spec: Tensor) -> str:
        return "data"

    def array(self, values: Any, spec: Tensor) -> np.ndarray:
        name, dtype = spec.name, np.dtype(spec.dtype)
        if not isinstance(values, list):
            raise InvalidRequest(f"input '{name}': data must be a list of numbers")
        try:
            a = np.asarray(values)
        except (ValueError, TypeError, OverflowError):  # ragged lists, ints past 64 bits
            raise InvalidRequest(
                f"input '{name}': data is not a list of numbers of one shape"
            ) from None
        if a.dtype.kind not in ("iuf" if dtype.kind == "f" else "iu") and a.size:
            raise InvalidRequest(
                f"input '{name}': data holds {a.dtype.name if a.dtype.kind != 'O' else 'mixed'}"
                f" values; the model takes {spec.datatype}"
            )
        if dtype.kind == "i" and a.size:
            info = np.iinfo(dtype)
            if a.min() < info.min or a.max() > info.max:
                raise InvalidRequest(f"input '{name}': data out of the range of {spec.datatype}")
        return a.astype(dtype, copy=False).reshape(-1)


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


class Infer:
    """An infer request's JSON header (and binary data) parsed: the tensors as sent, the
    outputs asked for and how they go back."""

    def __init__(self, body: bytes, header_length: str | None) -> None:
        if header_length is None:
            head, binary = body, b""
        else:
            n = int(header_length) if header_length.strip().isdigit() else -1
            if not 0 <= n <= len(body):
                raise InvalidRequest(
                    f"{HEADER_LENGTH}: {clip(header_length)}, the body has {len(body)} bytes"
                )
            head, binary = body[:n], body[n:]
        try:
            doc = json.loads(head)
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"the request is not JSON: {e}") from None
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
    infer = Infer(body, header_length)
    return model.arrays(lambda: decode(infer.sent, JSON), infer.outputs, len(body)), infer
