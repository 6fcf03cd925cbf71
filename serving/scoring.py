"""The exported artifact and its schema, independent of TorchServe (used by the handler).

The torch side of the wire format: :func:`to_tensors` wraps the codec's zero-copy numpy views,
:func:`slice_examples` and :meth:`ScoringModel.forward` cut and join encoded batches.
Shapes: ``B`` examples, ``F`` = 26 sparse features; ids are grouped feature-major.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import torch

try:  # inside a TorchServe worker, archive files sit side by side
    from codec import decode_request  # type: ignore[import-not-found]
except ImportError:
    from serving.codec import decode_request

Tensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# The views of a bytes body are read-only; the model never writes into its inputs, so torch's
# warning about it (once per process, from to_tensors) says nothing here.
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning, module=__name__
)


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


class ScoringModel:
    """The artifact and its schema, independent of TorchServe."""

    def __init__(self, model_dir: Path, artifact: str, device: torch.device) -> None:
        import fbgemm_gpu  # noqa: F401  registers the fbgemm ops the artifact calls

        self.schema = json.loads((model_dir / "schema.json").read_text())
        self.dense_names: list[str] = list(self.schema["features"]["dense"])
        self.sparse_names: list[str] = list(self.schema["features"]["sparse"])
        self.dense_count = len(self.dense_names)
        self.sparse_count = len(self.sparse_names)
        self.device = device
        self.model = torch.jit.load(str(model_dir / artifact), map_location=device)
        self.model.eval()

    def decode(self, body: bytes | bytearray) -> Tensors:
        """RSB1 bytes -> ``(dense f32[B,D], values i64[N], lengths i32[F,B])``."""
        return to_tensors(*decode_request(body, self.dense_count, self.sparse_count))

    def forward(self, requests: list[Tensors]) -> list[torch.Tensor]:
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
