"""The exported artifact and its schema, independent of TorchServe (used by the handler).

The torch side of the wire format: :func:`to_tensors` wraps the codec's zero-copy numpy views,
:func:`slice_examples` cuts an encoded batch (the codec's ``merge`` joins them, in numpy) and
:meth:`ScoringModel.forward` scores one. Shapes: ``B`` examples, ``F`` = 26 sparse features;
ids are grouped feature-major.
"""

from __future__ import annotations

import functools
import json
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import numpy as np

# torch alone loads and runs a portable model here (serving.tools.gpu_check, on a machine that may
# have no numpy); only decoding a request body needs the (numpy) codec.

# batch sizes a worker scores before it reports READY (see ScoringModel.warm_up)
WARM_UP_SIZES = (1, 100, 1000)
Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# The views of a bytes body are read-only; the model never writes into its inputs, so torch's
# warning about it (once per process, from to_tensors) says nothing here.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning, module=__name__
)


@functools.cache
def _decode_request() -> Callable[..., Any]:
    try:  # inside a TorchServe worker, archive files sit side by side
        from codec import decode_request  # type: ignore[import-not-found]
    except ImportError:
        from serving.worker.codec import decode_request
    return decode_request  # type: ignore[no-any-return]


@functools.cache
def _load_mapped() -> Callable[..., Any]:
    try:  # inside a TorchServe worker, archive files sit side by side
        from mapped import load_mapped  # type: ignore[import-not-found]
    except ImportError:
        from recsys_model.mapped import load_mapped
    return load_mapped  # type: ignore[no-any-return]


def to_tensors(dense: np.ndarray, values: np.ndarray, lengths: np.ndarray) -> Tensors:
    """The codec's arrays as tensors, sharing their memory (no copy)."""
    return torch.from_numpy(dense), torch.from_numpy(values), torch.from_numpy(lengths)


def slice_examples(
    dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor, lo: int, hi: int
) -> Tensors:
    """Examples ``[lo, hi)`` of an encoded batch, still feature-major."""
    by_feature = torch.split(values, lengths.sum(dim=1).tolist())
    parts = [
        f[int(ln[:lo].sum()) : int(ln[:hi].sum())]
        for f, ln in zip(by_feature, lengths, strict=True)
    ]
    return dense[lo:hi].contiguous(), torch.cat(parts), lengths[:, lo:hi].contiguous()


def variant_of(schema: dict[str, Any], artifact: str) -> dict[str, Any]:
    """The schema's record of ``artifact`` (older schemas: a TorchRec TorchScript file)."""
    torchrec = {"kind": "torchscript", "requires": ["torch", "fbgemm_gpu"]}
    for info in schema.get("variants", {}).values():
        if info.get("file") == artifact:
            return {**torchrec, **info}  # entries written before "requires" existed: TorchRec's
    return {"file": artifact, **torchrec}


def load_artifact(
    path: Path, variant: dict[str, Any], device: torch.device, dtype: torch.dtype | None
) -> Any:
    """Load a TorchScript (``.pt``), ``torch.export`` (``.pt2``) or mapped artifact on ``device``.

    fbgemm is imported only for the variants whose schema entry requires it (TorchRec's);
    ``dtype`` casts a portable scorer's weights (bf16 on CUDA); its output stays float32."""
    if "fbgemm_gpu" in variant.get("requires", []):
        import fbgemm_gpu  # noqa: F401  registers the fbgemm ops the artifact calls
    if variant.get("kind") == "mapped":  # tables mapped from their file, shared by workers
        if dtype is not None and device.type == "cpu":
            raise ValueError(f"{path.name}: on CPU a mapped variant is served in its own dtype")
        model = _load_mapped()(path, device)
        return model if dtype is None else model.to(dtype)  # on the device: bf16 from fp16
    if variant.get("kind", "torchscript") == "torchscript":
        model = torch.jit.load(str(path), map_location=device)
    elif variant["kind"] == "torch.export":
        program = torch.export.load(path)
        if device.type != "cpu":
            from torch.export.passes import move_to_device_pass

            program = move_to_device_pass(program, device)
        return program.module()  # in eval mode already (exported so); dtype: export another
    else:
        raise ValueError(f"{path.name}: a {variant['kind']} artifact is not loadable by torch")
    if dtype is not None:
        if variant.get("requires") != ["torch"]:
            raise ValueError(f"{path.name}: only a portable variant can be cast to {dtype}")
        model = model.to(dtype)
    return model.eval()


CUDA_DTYPES = {"fp32": None, "fp16": None, "bf16": torch.bfloat16}  # fp16 has its own file


def choose_variant(
    schema: dict[str, Any], default: str, device: torch.device, env: dict[str, str]
) -> tuple[str, str, torch.dtype | None]:
    """``(variant, file, dtype to cast to)`` a worker on ``device`` serves.

    ``RECSYS_VARIANT`` names a variant of ``schema["variants"]`` explicitly. Otherwise CPU
    serves the archive's file (``default``: the export's CPU choice, the mapped int8 tables by
    default); CUDA serves ``serving.cuda``: the mapped fp16 tables copied to the device (bf16
    cast from them when ``RECSYS_CUDA_DTYPE`` or the export's ``cuda_dtype`` says so), or, for
    an export whose CUDA choice is the portable TorchScript pair, that scorer in the dtype asked
    (fp16 from its own file, bf16 cast from fp32 at load). Raises ValueError."""
    variants: dict[str, Any] = schema.get("variants", {})
    by_file = {info["file"]: v for v, info in variants.items()}
    wanted = env.get("RECSYS_VARIANT", "")
    if wanted:
        if wanted not in variants or variants[wanted].get("kind") == "onnx":
            usable = [v for v, i in variants.items() if i.get("kind") != "onnx"]
            raise ValueError(f"RECSYS_VARIANT={wanted}: this export serves {', '.join(usable)}")
        return wanted, variants[wanted]["file"], None
    serving = schema.get("serving", {})
    if device.type == "cuda" and serving.get("cuda"):
        dtype = env.get("RECSYS_CUDA_DTYPE") or serving.get("cuda_dtype", "fp16")
        if dtype not in CUDA_DTYPES:
            raise ValueError(f"RECSYS_CUDA_DTYPE={dtype}: use one of {', '.join(CUDA_DTYPES)}")
        cuda = serving["cuda"]
        if variants.get(cuda, {}).get("kind") == "mapped":  # fp16 tables, copied to the device
            return cuda, variants[cuda]["file"], CUDA_DTYPES[dtype] if dtype == "bf16" else None
        name = f"{cuda}_fp16" if dtype == "fp16" else cuda
        if name in variants:
            return name, variants[name]["file"], CUDA_DTYPES[dtype]
    return by_file.get(default, default), default, None


class ScoringModel:
    """The artifact and its schema, independent of TorchServe."""

    def __init__(
        self,
        model_dir: Path,
        artifact: str,
        device: torch.device,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.schema = json.loads((model_dir / "schema.json").read_text())
        self.dense_names: list[str] = list(self.schema["features"]["dense"])
        self.sparse_names: list[str] = list(self.schema["features"]["sparse"])
        self.dense_count = len(self.dense_names)
        self.sparse_count = len(self.sparse_names)
        self.device = device
        self.variant = variant_of(self.schema, artifact)
        if not (model_dir / artifact).is_file():
            here = sorted(
                p.name for p in model_dir.iterdir() if p.name.startswith(("model_", "mapped_"))
            )
            raise ValueError(f"{artifact} is not in {model_dir} (it has {', '.join(here)})")
        self.model = load_artifact(model_dir / artifact, self.variant, device, dtype)

    def warm_up(self, sizes: tuple[int, ...] = WARM_UP_SIZES, rounds: int = 3) -> float:
        """Score synthetic batches of each size ``rounds`` times; returns the seconds taken.

        TorchScript profiles and re-optimizes a graph on its first calls at new shapes: a fresh
        worker's first forwards took seconds (longer than the gateway's probe deadline, so a
        restarted replica stayed out of rotation). Paying it before READY keeps the first real
        requests as fast as the rest."""
        t0 = time.perf_counter()
        for b in sizes:
            x = (
                torch.zeros((b, self.dense_count), dtype=torch.float32),
                torch.zeros(self.sparse_count * b, dtype=torch.int64),
                torch.ones((self.sparse_count, b), dtype=torch.int32),
            )
            for _ in range(rounds):
                self.forward(x)
        return time.perf_counter() - t0

    def decode(self, body: bytes | bytearray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """RSB1 bytes -> ``(dense f32[B,D], values i64[N], lengths i32[F,B])``, the codec's
        zero-copy numpy views (requests are merged as arrays, then :func:`to_tensors`)."""
        return _decode_request()(body, self.dense_count, self.sparse_count)  # type: ignore[no-any-return]

    def forward(self, batch: Tensors, model: Any = None) -> torch.Tensor:
        """One encoded batch ``(dense f32[B,D], values i64[N], lengths i32[F,B])`` -> its
        probabilities ``f32[B]`` on CPU (several requests: merged into one batch first, by
        the codec's ``merge``; their scores are consecutive slices of these). ``model``: the
        one to score with (a delta chain's version, taken once per batch), else the artifact's."""
        dense, values, lengths = batch
        with torch.inference_mode():
            probs = (model or self.model)(
                dense.to(self.device), values.to(self.device), lengths.to(self.device)
            )
        return probs.float().cpu()
