"""KServe v2 / Open Inference Protocol on the gateway: ``inference.GRPCInferenceService``.

Served beside ``recsys.v1.Ranker`` on the same port, so clients of the common protocol
(``tritonclient.grpc``, Triton's ``perf_analyzer``, KServe and MLServer clients) call the model
unmodified; the same protocol over HTTP/JSON is :mod:`serving.gateway.rest`. The model takes
the artifact's own tensors (``schema.json``, feature order from it):

* input ``dense``   FP32  ``[B, D]``  raw dense values (missing = 0)
* input ``values``  INT64 ``[N]``     raw non-negative ids, grouped by feature, then example
* input ``lengths`` INT32 ``[F, B]``  ids per (feature, example); 0 = missing
* output ``scores`` FP32  ``[B]``     click probabilities

:class:`Model` is what both protocols answer, once: metadata, readiness, the model and version
a call is for, tensor decoding (:func:`decode_tensors`: a protocol only says how it holds a
tensor's values, :class:`Form`) and scoring. Over gRPC, tensors come as typed ``contents`` or
``raw_input_contents`` (little-endian, row-major); the reply uses the same form. A request is
decoded, then checked by :func:`serving.gateway.validate.validate_arrays` and scored by
:meth:`Scorer.score_arrays`, like ``Score``: the same limits, checks, coalescing, backends,
status codes and metrics (the auth and metrics interceptors cover every service).
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import grpc
import numpy as np

from serving.gateway import metrics
from serving.gateway.errors import ScoreError
from serving.gateway.rpc import add_servicer
from serving.gateway.validate import InvalidRequest, Schema, clip, validate_arrays
from serving.plan import ordered
from serving.stubs import kserve_pb2, kserve_pb2_grpc

if TYPE_CHECKING:
    from serving.gateway.coalesce import Arrays
    from serving.gateway.service import Scorer

SERVICE = "inference.GRPCInferenceService"
SERVER_NAME = "recsys-gateway"
PLATFORM = "pytorch_torchscript"
OUTPUT = "scores"
# KServe v2 extensions served (server metadata): Triton's binary tensor data, over HTTP
EXTENSIONS = ("binary_tensor_data",)


@dataclass(frozen=True)
class Tensor:
    """One tensor of the model's contract: KServe datatype, numpy dtype, typed-contents field."""

    name: str
    datatype: str
    dtype: str  # little-endian numpy dtype of raw contents
    field: str  # InferTensorContents field of typed contents
    dims: int  # dimensions of the model's tensor (its shape's length)

    def shape(self, schema: Schema) -> list[int]:
        """The tensor's shape in metadata; -1 = any (batch, ids)."""
        return {
            "dense": [-1, len(schema.dense)],
            "values": [-1],
            "lengths": [len(schema.sparse), -1],
            OUTPUT: [-1],
        }[self.name]


INPUTS = (
    Tensor("dense", "FP32", "<f4", "fp32_contents", 2),
    Tensor("values", "INT64", "<i8", "int64_contents", 1),
    Tensor("lengths", "INT32", "<i4", "int_contents", 2),
)
SPECS = {s.name: s for s in INPUTS}
SCORES = Tensor(OUTPUT, "FP32", "<f4", "fp32_contents", 1)
# dimensions of a shape echoed in an error (a shape is as long as the client makes it)
ECHO_DIMS = 8


class Sent(NamedTuple):
    """One input tensor as a client sent it, whatever the protocol."""

    name: str
    datatype: str
    shape: list[int]
    raw: bytes | None  # its bytes, when sent raw (gRPC raw_input_contents, HTTP binary data)
    values: Any  # its typed values (gRPC contents, HTTP "data"); None = none sent


class Form:
    """How a protocol holds a tensor's typed values, and names both forms in errors: gRPC's
    ``InferTensorContents`` here (HTTP's JSON ``data``: :mod:`serving.gateway.rest`)."""

    typed = "contents"
    raw = "raw_input_contents"

    def where(self, spec: Tensor) -> str:
        return f"contents.{spec.field}"

    def array(self, values: Any, spec: Tensor) -> np.ndarray:
        """``values`` as a flat array of ``spec``'s dtype (InvalidRequest if they are not)."""
        return np.asarray(getattr(values, spec.field), dtype=spec.dtype)


GRPC = Form()


def _shown(shape: list[int]) -> str:
    """``shape`` for an error message, cut after :data:`ECHO_DIMS` dimensions."""
    if len(shape) <= ECHO_DIMS:
        return str(shape)
    return f"{str(shape[:ECHO_DIMS])[:-1]}, ...]"


def _tensor(t: Sent, spec: Tensor, form: Form) -> np.ndarray:
    """One tensor as sent -> a numpy array of its shape."""
    if t.datatype != spec.datatype:
        raise InvalidRequest(
            f"input '{t.name}': datatype {t.datatype or '(none)'}, the model takes {spec.datatype}"
        )
    shape = t.shape
    if len(shape) != spec.dims:  # before any arithmetic: numpy takes at most 32 or 64
        raise InvalidRequest(
            f"input '{t.name}': shape {_shown(shape)} has {len(shape)} dimensions; the model "
            f"takes {spec.dims}"
        )
    if any(d < 0 for d in shape):
        raise InvalidRequest(f"input '{t.name}': shape {shape} has a negative dimension")
    # exact (Python ints): np.prod in int64 wrapped [2^32, 2^32] to 0 elements, which 0 bytes
    # matched, and the reshape below raised (UNKNOWN); a count this large matches nothing sent
    count = math.prod(shape)
    if t.raw is not None:
        if t.values is not None:
            raise InvalidRequest(f"input '{t.name}': typed {form.typed} and {form.raw} together")
        itemsize = np.dtype(spec.dtype).itemsize
        if len(t.raw) != count * itemsize:
            raise InvalidRequest(
                f"input '{t.name}': {len(t.raw)} raw bytes, but shape {shape} of "
                f"{spec.datatype} needs {count * itemsize}"
            )
        array = np.frombuffer(t.raw, dtype=spec.dtype)
    else:
        array = form.array(t.values, spec) if t.values is not None else np.zeros(0, spec.dtype)
        if array.size != count:
            raise InvalidRequest(
                f"input '{t.name}': {array.size} values in {form.where(spec)}, but shape "
                f"{shape} needs {count}"
            )
    return array.reshape(shape)


def check_count(what: str, count: int) -> None:
    """At most one entry per model input (checked before any loop walks them)."""
    if count > len(INPUTS):
        raise InvalidRequest(f"{what}: {count} entries; the model takes {len(INPUTS)} inputs")


def decode_tensors(sent: Sequence[Sent], form: Form) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tensors as sent -> ``(dense, values, lengths)`` (checked for form only: names,
    datatypes, element counts); :func:`validate_arrays` checks them against the model."""
    check_count("inputs", len(sent))
    got: dict[str, np.ndarray] = {}
    for t in sent:
        spec = SPECS.get(t.name)
        if spec is None:
            raise InvalidRequest(
                f"input {clip(t.name)}: unknown (the model takes {', '.join(SPECS)})"
            )
        if t.name in got:
            raise InvalidRequest(f"input '{t.name}' appears twice")
        got[t.name] = _tensor(t, spec, form)
    missing = [name for name in SPECS if name not in got]
    if missing:
        raise InvalidRequest(f"missing input(s): {', '.join(missing)}")
    return got["dense"], got["values"], got["lengths"]


def decode_inputs(request: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``ModelInferRequest`` -> ``(dense, values, lengths)`` (:func:`decode_tensors`)."""
    check_count("inputs", len(request.inputs))
    check_count("raw_input_contents", len(request.raw_input_contents))
    raws = list(request.raw_input_contents)
    if raws and len(raws) != len(request.inputs):
        raise InvalidRequest(
            f"raw_input_contents: {len(raws)} entries for {len(request.inputs)} inputs"
        )
    sent = [
        Sent(
            t.name,
            t.datatype,
            [int(d) for d in t.shape],
            raws[k] if raws else None,
            t.contents if not raws or t.HasField("contents") else None,
        )
        for k, t in enumerate(request.inputs)
    ]
    return decode_tensors(sent, GRPC)


def reply_id(client_id: str, request_id: str) -> str:
    """A reply's ``id``: the client's own id when it gave one (echoed, as the protocol says),
    else the gateway's request id (which is always in the reply's ``parameters.request_id``:
    the one a ``Feedback`` click names)."""
    return client_id or request_id


def encode_scores(
    request: Any, scores: np.ndarray, version: str, raw: bool, request_id: str = ""
) -> Any:
    """Scores f32[B] -> ``ModelInferResponse`` (raw or typed, as the request was)."""
    reply = kserve_pb2.ModelInferResponse(
        model_name=request.model_name, model_version=version, id=reply_id(request.id, request_id)
    )
    out = reply.outputs.add(name=OUTPUT, datatype=SCORES.datatype, shape=[int(scores.size)])
    if raw:
        reply.raw_output_contents.append(scores.astype(SCORES.dtype).tobytes())
    else:
        getattr(out.contents, SCORES.field).extend(scores.tolist())
    return reply


class Scored(NamedTuple):
    """A scored request: the scores, what scored them, and what the answer says about it."""

    scores: np.ndarray
    backend: str
    version: str
    parameters: dict[str, str]  # the answer's parameters: backend, device, variant, dtype
    metadata: tuple[tuple[str, str], ...]  # gRPC trailing metadata, HTTP response headers
    request_id: str  # the gateway's (serving/gateway/request_ids.py): what a click names


class Model:
    """The KServe v2 model and server, whatever the protocol: both front doors answer these.

    Raises :class:`ScoreError` (NOT_FOUND for a model or version not served) and
    :class:`InvalidRequest`; each protocol maps them to its own status."""

    def __init__(self, ranker: Scorer) -> None:
        self.ranker = ranker
        self.serving = True
        """False while the gateway's health is NOT_SERVING (set by its health poller, and
        when it stops): server readiness says what ``grpc.health.v1`` says."""

    @property
    def schema(self) -> Schema:
        return self.ranker.schema

    def version(self, name: str, version: str) -> str:
        """The version a call on model ``name`` is for (empty = the plan's choice); NOT_FOUND
        if the gateway does not serve it."""
        plan = self.ranker.plan
        if name != plan.model:
            raise ScoreError(
                grpc.StatusCode.NOT_FOUND,
                f"model {clip(name)} is not served here (this gateway serves '{plan.model}')",
            )
        # the gateway's one version check (Ranker.resolve), the default when none named
        return self.ranker.resolve(version or plan.default)

    def server_ready(self) -> bool:
        return self.serving and self.ranker.pool.ready(self.ranker.plan.default)

    def model_ready(self, name: str, version: str) -> bool:
        return self.ranker.pool.ready(self.version(name, version))

    def server_metadata(self) -> dict[str, Any]:
        try:
            version = importlib.metadata.version("recsys-stack")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        return {"name": SERVER_NAME, "version": version, "extensions": list(EXTENSIONS)}

    def model_metadata(self, name: str, version: str) -> dict[str, Any]:
        self.version(name, version)
        plan = self.ranker.plan

        def meta(s: Tensor) -> dict[str, Any]:
            return {"name": s.name, "datatype": s.datatype, "shape": s.shape(self.schema)}

        return {
            "name": plan.model,
            "versions": list(ordered(plan)),  # the default first
            "platform": PLATFORM,
            "inputs": [meta(s) for s in INPUTS],
            "outputs": [meta(SCORES)],
        }

    def arrays(
        self,
        decode: Callable[[], tuple[np.ndarray, np.ndarray, np.ndarray]],
        outputs: Iterable[str],
        request_bytes: int,
    ) -> Arrays:
        """The outputs asked for, and the decoded tensors checked like every API's requests
        (:func:`validate_arrays`); InvalidRequest (the caller counts it)."""
        for out in outputs:
            if out != OUTPUT:
                raise InvalidRequest(f"output {clip(out)}: unknown (the model has 'scores')")
        return validate_arrays(
            *decode(), self.schema, self.ranker.cfg.limits, request_bytes, field="dense (examples)"
        )

    async def score(
        self, arrays: Arrays, version: str, time_remaining: float | None, log: bool = True
    ) -> Scored:
        """The one scoring path (and version routing) of every API; ``log`` False: the call
        opted out of the feature log (``Ranker.logs``)."""
        got = await self.ranker.score_arrays(arrays, version, time_remaining, log)
        scores, backend, version, request_id = got
        pool = self.ranker.pool
        # what scored it, in the protocol's own place for it (ModelMetadata has no parameters);
        # the gateway's request id there too, whatever ``id`` the client gave (reply_id)
        params = {"backend": backend, **pool.served(backend, version), "request_id": request_id}
        return Scored(
            scores, backend, version, params, pool.call_metadata(backend, version), request_id
        )


class KServe(kserve_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """``inference.GRPCInferenceService`` over the gateway's :class:`Model`."""

    def __init__(self, model: Model) -> None:
        self.model = model

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return kserve_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return kserve_pb2.ServerReadyResponse(ready=self.model.server_ready())

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            ready = self.model.model_ready(request.name, request.version)
        except ScoreError as e:
            await context.abort(e.code, e.message)
        return kserve_pb2.ModelReadyResponse(ready=ready)

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return kserve_pb2.ServerMetadataResponse(**self.model.server_metadata())

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            got = self.model.model_metadata(request.name, request.version)
        except ScoreError as e:
            await context.abort(e.code, e.message)
        meta = kserve_pb2.ModelMetadataResponse
        return meta(
            name=got["name"],
            versions=got["versions"],
            platform=got["platform"],
            inputs=[meta.TensorMetadata(**t) for t in got["inputs"]],
            outputs=[meta.TensorMetadata(**t) for t in got["outputs"]],
        )

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        model = self.model
        try:
            if request.model_name != model.ranker.plan.model:
                model.version(request.model_name, request.model_version)  # NOT_FOUND
        except ScoreError as e:
            await context.abort(e.code, e.message)
        try:
            arrays = model.arrays(
                lambda: decode_inputs(request), (o.name for o in request.outputs),
                request.ByteSize(),
            )  # fmt: skip
        except InvalidRequest as e:
            metrics.rejected("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            scored = await model.score(
                arrays, request.model_version, context.time_remaining(),
                model.ranker.logs(context.invocation_metadata()),
            )  # fmt: skip
        except ScoreError as e:
            await context.abort(e.code, e.message)
        context.set_trailing_metadata(scored.metadata)
        reply = encode_scores(
            request, scored.scores, scored.version, bool(request.raw_input_contents),
            scored.request_id,
        )  # fmt: skip
        for key, value in scored.parameters.items():
            reply.parameters[key].string_param = value
        return reply


def add_to_server(model: Model, server: grpc.aio.Server) -> None:
    """Register the KServe v2 service for ``model`` on ``server``."""
    # bytes that are no message: INVALID_ARGUMENT, as for Score (serving/gateway/rpc.py)
    add_servicer(server, kserve_pb2_grpc.add_GRPCInferenceServiceServicer_to_server, KServe(model))
