"""The portable scorer as ONNX (dynamic batch, the artifact's signature), run by onnxruntime.

The bags are pooled with one flat gather and a segment sum (``bags="scatter"``: Gather +
ScatterElements(add) in ONNX): ``F.embedding_bag``'s ONNX lowering loops over bags and was
measured ~90x slower at batch 100 (docs/bench.md).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from recsys_model.portable_model import PortableScorer, from_state, to_state

logger = logging.getLogger("training.export")
INPUTS = ("dense", "values", "lengths")


def export_onnx(scorer: PortableScorer, example: tuple[torch.Tensor, ...], path: Path) -> None:
    """Write ``scorer`` (its scatter-pooling twin) to ``path`` as one self-contained ONNX file."""
    twin = from_state(to_state(scorer), bags="scatter")
    batch, ids = torch.export.Dim("batch", min=1), torch.export.Dim("ids", min=0)
    shapes = {"dense": {0: batch}, "values": {0: ids}, "lengths": {1: batch}}
    program = torch.onnx.export(
        twin,
        example,
        input_names=list(INPUTS),
        output_names=["probs"],
        dynamic_shapes=shapes,
        dynamo=True,
        external_data=False,
        verbose=False,
    )
    assert program is not None
    program.save(str(path), external_data=False)


class OnnxScorer:
    """An onnxruntime session behind the scorer's ``(dense, values, lengths) -> probs``."""

    def __init__(self, path: Path, threads: int = 0) -> None:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        # as many threads as torch, and no spinning between runs: a spinning pool steals the
        # cores from whatever runs next (measured: torch's latency tripled beside it)
        opts.intra_op_num_threads = threads or torch.get_num_threads()
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(
            str(path), sess_options=opts, providers=["CPUExecutionProvider"]
        )

    def __call__(
        self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        feed = {n: t.numpy() for n, t in zip(INPUTS, (dense, values, lengths), strict=True)}
        return torch.from_numpy(self.session.run(None, feed)[0])
