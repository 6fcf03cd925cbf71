"""KServe v2 / Open Inference Protocol on the gateway: ``inference.GRPCInferenceService``.

Served beside ``recsys.v1.Ranker`` on the same port, so clients of the common protocol
(``tritonclient.grpc``, Triton's ``perf_analyzer``, KServe and MLServer clients) call the model
unmodified. The model takes the artifact's own tensors (``schema.json``, feature order from it):

* input ``dense``   FP32  ``[B, D]``  raw dense values (missing = 0)
* input ``values``  INT64 ``[N]``     raw non-negative ids, grouped by feature, then example
* input ``lengths`` INT32 ``[F, B]``  ids per (feature, example); 0 = missing
* output ``scores`` FP32  ``[B]``     click probabilities

Tensors come as typed ``contents`` or ``raw_input_contents`` (little-endian, row-major); the
reply uses the same form. A request is decoded here, then checked by
:func:`serving.gateway.validate.validate_arrays` and scored by :meth:`Scorer.score_arrays`, like
``Score``: the same limits, checks, coalescing, backends, status codes and metrics (the auth and
metrics interceptors cover every service).
"""

from __future__ import annotations

import importlib.metadata
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
import numpy as np

from serving.gateway import metrics
from serving.gateway.errors import ScoreError
from serving.gateway.rpc import add_servicer
from serving.gateway.validate import InvalidRequest, Schema, clip, validate_arrays
from serving.plan import ordered
from serving.stubs import kserve_pb2, kserve_pb2_grpc

if TYPE_CHECKING:
    from serving.gateway.service import Scorer

SERVICE = "inference.GRPCInferenceService"
SERVER_NAME = "recsys-gateway"
PLATFORM = "pytorch_torchscript"
OUTPUT = "scores"


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
SCORES = Tensor(OUTPUT, "FP32", "<f4", "fp32_contents", 1)
# dimensions of a shape echoed in an error (a shape is as long as the client makes it)
ECHO_DIMS = 8


def _shown(shape: list[int]) -> str:
    """``shape`` for an error message, cut after :data:`ECHO_DIMS` dimensions."""
    if len(shape) <= ECHO_DIMS:
        return str(shape)
    return f"{str(shape[:ECHO_DIMS])[:-1]}, ...]"


def _tensor(t: Any, spec: Tensor, raw: bytes | None) -> np.ndarray:
    """One ``InferInputTensor`` (and its raw bytes, if sent raw) -> a numpy array of its shape."""
    if t.datatype != spec.datatype:
        raise InvalidRequest(
            f"input '{t.name}': datatype {t.datatype or '(none)'}, the model takes {spec.datatype}"
        )
    shape = [int(d) for d in t.shape]
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
    if raw is not None:
        if t.HasField("contents"):
            raise InvalidRequest(
                f"input '{t.name}': typed contents and raw_input_contents together"
            )
        itemsize = np.dtype(spec.dtype).itemsize
        if len(raw) != count * itemsize:
            raise InvalidRequest(
                f"input '{t.name}': {len(raw)} raw bytes, but shape {shape} of {spec.datatype} "
                f"needs {count * itemsize}"
            )
        array = np.frombuffer(raw, dtype=spec.dtype)
    else:
        values = getattr(t.contents, spec.field)
        if len(values) != count:
            raise InvalidRequest(
                f"input '{t.name}': {len(values)} values in contents.{spec.field}, but shape "
                f"{shape} needs {count}"
            )
        array = np.asarray(values, dtype=spec.dtype)
    return array.reshape(shape)


def decode_inputs(request: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``ModelInferRequest`` -> ``(dense, values, lengths)`` as sent (checked for form only:
    names, datatypes, element counts); :func:`validate_arrays` checks them against the model."""
    for what, count in (
        ("inputs", len(request.inputs)),
        ("raw_input_contents", len(request.raw_input_contents)),
    ):
        if count > len(INPUTS):  # bounded before any loop walks them
            raise InvalidRequest(f"{what}: {count} entries; the model takes {len(INPUTS)} inputs")
    raws = list(request.raw_input_contents)
    if raws and len(raws) != len(request.inputs):
        raise InvalidRequest(
            f"raw_input_contents: {len(raws)} entries for {len(request.inputs)} inputs"
        )
    specs = {s.name: s for s in INPUTS}
    got: dict[str, np.ndarray] = {}
    for k, t in enumerate(request.inputs):
        spec = specs.get(t.name)
        if spec is None:
            raise InvalidRequest(f"input '{t.name}': unknown (the model takes {', '.join(specs)})")
        if t.name in got:
            raise InvalidRequest(f"input '{t.name}' appears twice")
        got[t.name] = _tensor(t, spec, raws[k] if raws else None)
    missing = [name for name in specs if name not in got]
    if missing:
        raise InvalidRequest(f"missing input(s): {', '.join(missing)}")
    return got["dense"], got["values"], got["lengths"]


def encode_scores(request: Any, scores: np.ndarray, version: str, raw: bool) -> Any:
    """Scores f32[B] -> ``ModelInferResponse`` (raw or typed, as the request was)."""
    reply = kserve_pb2.ModelInferResponse(
        model_name=request.model_name, model_version=version, id=request.id
    )
    out = reply.outputs.add(name=OUTPUT, datatype=SCORES.datatype, shape=[int(scores.size)])
    if raw:
        reply.raw_output_contents.append(scores.astype(SCORES.dtype).tobytes())
    else:
        getattr(out.contents, SCORES.field).extend(scores.tolist())
    return reply


class KServe(kserve_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """``inference.GRPCInferenceService`` over the gateway's :class:`Scorer`."""

    def __init__(self, ranker: Scorer) -> None:
        self.ranker = ranker

    @property
    def schema(self) -> Schema:
        return self.ranker.schema

    def _ready(self) -> bool:
        return self.ranker.pool.ready(self.ranker.plan.default)

    async def _model(self, name: str, version: str, context: grpc.aio.ServicerContext) -> str:
        """The version a call on model ``name`` is for (empty = the default); NOT_FOUND if the
        gateway does not serve it."""
        plan = self.ranker.plan
        if name != plan.model:
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"model {clip(name)} is not served here (this gateway serves '{plan.model}')",
            )
        try:  # the gateway's one version check (Ranker.resolve), the default when none named
            version = self.ranker.resolve(version or plan.default)
        except ScoreError as e:
            await context.abort(e.code, e.message)
        return version

    async def ServerLive(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return kserve_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return kserve_pb2.ServerReadyResponse(ready=self._ready())

    async def ModelReady(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        version = await self._model(request.name, request.version, context)
        return kserve_pb2.ModelReadyResponse(ready=self.ranker.pool.ready(version))

    async def ServerMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            version = importlib.metadata.version("recsys-stack")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        return kserve_pb2.ServerMetadataResponse(name=SERVER_NAME, version=version)

    async def ModelMetadata(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        await self._model(request.name, request.version, context)
        meta = kserve_pb2.ModelMetadataResponse
        return meta(
            name=self.ranker.plan.model,
            versions=list(ordered(self.ranker.plan)),  # the default first
            platform=PLATFORM,
            inputs=[
                meta.TensorMetadata(name=s.name, datatype=s.datatype, shape=s.shape(self.schema))
                for s in INPUTS
            ],
            outputs=[
                meta.TensorMetadata(
                    name=OUTPUT, datatype=SCORES.datatype, shape=SCORES.shape(self.schema)
                )
            ],
        )

    async def ModelInfer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        if request.model_name != self.ranker.plan.model:
            await self._model(request.model_name, request.model_version, context)
        try:
            for out in request.outputs:
                if out.name != OUTPUT:
                    raise InvalidRequest(f"output '{out.name}': unknown (the model has 'scores')")
            arrays = validate_arrays(
                *decode_inputs(request),
                self.schema,
                self.ranker.cfg.limits,
                request.ByteSize(),
                field="dense (examples)",
            )
        except InvalidRequest as e:
            metrics.rejected("invalid")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:  # the one scoring path (and version routing) of every API
            scores, backend, version = await self.ranker.score_arrays(
                arrays, request.model_version, context.time_remaining()
            )
        except ScoreError as e:
            await context.abort(e.code, e.message)
        context.set_trailing_metadata(self.ranker.pool.call_metadata(backend, version))
        reply = encode_scores(request, scores, version, raw=bool(request.raw_input_contents))
        # what scored it, in the protocol's own place for it (ModelMetadata has no parameters)
        for key, value in {"backend": backend, **self.ranker.pool.served(backend, version)}.items():
            reply.parameters[key].string_param = value
        return reply


def add_to_server(ranker: Scorer, server: grpc.aio.Server) -> None:
    """Register the KServe v2 service for ``ranker``'s model on ``server``."""
    # bytes that are no message: INVALID_ARGUMENT, as for Score (serving/gateway/rpc.py)
    add_servicer(server, kserve_pb2_grpc.add_GRPCInferenceServiceServicer_to_server, KServe(ranker))
