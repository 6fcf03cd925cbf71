"""TorchServe handler for the exported scorer: binary requests in, probabilities out.

Stages (LitServe-style, each testable without a server): ``load`` (artifact + schema, device
choice) -> ``decode`` each request -> ``forward`` one concatenated batch -> ``split`` back per
request. TorchServe's batching (``batch_size``, ``max_batch_delay``) hands ``handle`` several
requests of different sizes; they run as one forward. A malformed request fails alone (HTTP
400 with the reason) and never takes the worker or its batch-mates down.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

try:  # inside a TorchServe worker
    from ts.torch_handler.base_handler import BaseHandler
except ImportError:  # pragma: no cover - unit tests without TorchServe
    BaseHandler = object  # type: ignore[misc,assignment]

try:  # TorchServe puts the archive's extra files beside the handler, not in a package
    from codec import CodecError, decode_request, encode_response  # type: ignore[import-not-found]
except ImportError:
    from serving.codec import CodecError, decode_request, encode_response

logger = logging.getLogger(__name__)


def choose_device(gpu_id: int | None, cuda_available: bool) -> torch.device:
    """``cuda:<gpu_id>`` when TorchServe assigned a GPU and CUDA works, else CPU."""
    if gpu_id is not None and cuda_available:
        return torch.device(f"cuda:{gpu_id}")
    return torch.device("cpu")


def cpu_threads(env: dict[str, str], cores: int, workers: int) -> int:
    """Intra-op threads per worker: RECSYS_THREADS, else the cores shared among the workers."""
    if env.get("RECSYS_THREADS"):
        return max(1, int(env["RECSYS_THREADS"]))
    return max(1, cores // max(workers, 1))


class ScoringModel:
    """The artifact and its schema, independent of TorchServe."""

    def __init__(self, model_dir: Path, artifact: str, device: torch.device) -> None:
        import fbgemm_gpu  # noqa: F401  registers the fbgemm ops the artifact calls

        self.schema = json.loads((model_dir / "schema.json").read_text())
        self.dense_count = len(self.schema["features"]["dense"])
        self.sparse_count = len(self.schema["features"]["sparse"])
        self.device = device
        self.model = torch.jit.load(str(model_dir / artifact), map_location=device)
        self.model.eval()

    def decode(self, body: bytes | bytearray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return decode_request(body, self.dense_count, self.sparse_count)

    def forward(
        self, requests: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    ) -> list[torch.Tensor]:
        """Concatenate requests (B_i examples each) into one batch, score, split back."""
        sizes = [d.shape[0] for d, _, _ in requests]
        dense = torch.cat([d for d, _, _ in requests])
        lengths = torch.cat([ln for _, _, ln in requests], dim=1)  # [F, sum B]
        # values are feature-major per request; regroup them feature-major for the whole batch
        per_feature = [torch.split(v, ln.sum(dim=1).tolist()) for _, v, ln in requests]
        values = torch.cat(
            [chunk for f in range(lengths.shape[0]) for chunk in (p[f] for p in per_feature)]
        )
        with torch.inference_mode():
            probs = self.model(
                dense.to(self.device), values.to(self.device), lengths.to(self.device)
            )
        return list(torch.split(probs.float().cpu(), sizes))


class RecsysHandler(BaseHandler):  # type: ignore[misc,valid-type]
    """TorchServe entry point (``--handler serving/handler.py``)."""

    def initialize(self, context: Any) -> None:
        props = context.system_properties
        gpu_id = props.get("gpu_id")
        device = choose_device(None if gpu_id is None else int(gpu_id), torch.cuda.is_available())
        if device.type == "cpu":
            workers = int(os.environ.get("RECSYS_WORKERS", "1"))
            torch.set_num_threads(cpu_threads(dict(os.environ), os.cpu_count() or 1, workers))
        artifact = context.manifest["model"]["serializedFile"]
        self.scoring = ScoringModel(Path(props["model_dir"]), artifact, device)
        self.initialized = True
        logger.info(
            "recsys handler: %s on %s (%d threads)", artifact, device, torch.get_num_threads()
        )

    def handle(self, data: list[dict[str, Any]], context: Any) -> list[Any]:
        decoded: list[Any] = []
        for i, row in enumerate(data):
            body = row.get("data") or row.get("body")
            try:
                if not isinstance(body, bytes | bytearray):
                    raise CodecError(f"expected a binary body, got {type(body).__name__}")
                decoded.append(self.scoring.decode(body))
            except CodecError as e:
                context.set_response_status(400, str(e), idx=i)
                decoded.append(str(e))
        good = [i for i, x in enumerate(decoded) if not isinstance(x, str)]
        out: list[Any] = [f"invalid request: {x}" if isinstance(x, str) else None for x in decoded]
        if good:
            for i, probs in zip(
                good, self.scoring.forward([decoded[i] for i in good]), strict=True
            ):
                out[i] = encode_response(probs)
        return out
