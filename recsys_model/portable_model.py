"""A pure-PyTorch DLRM scorer: torch alone, no TorchRec, no fbgemm, no numpy.

The export (``training/export/portable.py``) copies a trained TorchRec DLRM's weights into
:class:`PortableScorer`, then saves it as TorchScript, as a ``torch.export`` program and as
ONNX. Only ``torch`` is imported here, so a machine with a CUDA torch and nothing else (no
fbgemm wheel pinned to its torch) can rebuild, load and check the model
(``python -m serving.tools.gpu_check``).

Same signature and preprocessing as the TorchRec scorer (``training/export/scorer.py``): the
very functions of :mod:`recsys_model.features`, which training's loader calls too.

* ``dense``   float32[B, 13]  raw values (missing = 0) -> ``log1p(max(x, 0))``
* ``values``  int64[N]        raw ids, grouped by feature (schema order), then by example
* ``lengths`` int32[F, B]     ids per (feature, example); ``N = lengths.sum()``

Output: float32[B] probabilities, whatever the weights' dtype (fp32, fp16, bf16).

All ``F`` tables live in one ``[sum(rows), E]`` weight with per-table row offsets, so the bags
are one lookup. Two ways to pool them (``bags``):

* ``"embedding_bag"``: ``F.embedding_bag`` with offsets (TorchScript, ``torch.export``: one
  fused kernel on CPU and CUDA);
* ``"scatter"``: one flat gather and a segment sum (``index_add``), which ONNX expresses as a
  Gather + ScatterElements; the ONNX lowering of ``embedding_bag`` loops per bag (slow).
"""

import itertools
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

try:  # inside a TorchServe worker the archive's files sit side by side
    from features import dense_transform, hash_ids, hash_values  # type: ignore[import-not-found]
except ImportError:
    from recsys_model.features import dense_transform, hash_ids, hash_values

BAG_MODES = ("embedding_bag", "scatter")


class PortableScorer(nn.Module):
    """``(dense f32[B,13], values i64[N], lengths i32[F,B]) -> probabilities f32[B]``.

    ``spec`` (stored beside the weights, see :func:`to_state`): ``rows`` per table, ``dim``
    (E), ``dense_arch`` / ``over_arch`` layer sizes, ``num_dense``, ``arch`` (``dlrm`` or
    ``dlrm_dcn`` with ``dcn_num_layers`` / ``dcn_low_rank_dim``).
    """

    rows: torch.Tensor
    row_offsets: torch.Tensor
    triu: torch.Tensor

    def __init__(self, spec: dict[str, Any], bags: str = "embedding_bag") -> None:
        super().__init__()
        if bags not in BAG_MODES:
            raise ValueError(f"bags = {bags!r}: use one of {', '.join(BAG_MODES)}")
        if spec["arch"] not in ("dlrm", "dlrm_dcn"):
            raise ValueError(f"arch = {spec['arch']!r}: the portable scorer knows dlrm, dlrm_dcn")
        rows = [int(r) for r in spec["rows"]]
        dim = int(spec["dim"])
        self.spec = dict(spec)
        self.scatter: bool = bags == "scatter"
        self.num_features: int = len(rows)
        self.dim: int = dim
        self.register_buffer("rows", torch.tensor(rows, dtype=torch.int64))
        starts = [0]
        for r in rows[:-1]:
            starts.append(starts[-1] + r)
        self.register_buffer("row_offsets", torch.tensor(starts, dtype=torch.int64))
        # empty, not zeros: a skeleton whose tables are filled or mapped later touches no page
        self.weight = nn.Parameter(torch.empty(sum(rows), dim), requires_grad=False)
        sizes = [int(spec["num_dense"]), *spec["dense_arch"]]
        self.dense = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))
        feats = len(rows) + 1
        self.dcn_layers: int = (
            int(spec.get("dcn_num_layers", 0)) if spec["arch"] == "dlrm_dcn" else 0
        )
        # both interaction kinds' tensors exist (empty when unused): TorchScript types them all
        width, rank = feats * dim, int(spec.get("dcn_low_rank_dim", 0)) if self.dcn_layers else 0
        self.dcn_v = nn.Parameter(torch.zeros(self.dcn_layers, rank, width), requires_grad=False)
        self.dcn_w = nn.Parameter(torch.zeros(self.dcn_layers, width, rank), requires_grad=False)
        self.dcn_b = nn.Parameter(torch.zeros(self.dcn_layers, width), requires_grad=False)
        # dot interactions: the upper triangle of [F+1, F+1], diagonal excluded. On CPU even
        # when built under ``torch.device("meta")`` (a mapped scorer's skeleton): the meta
        # triu_indices is torch._refs', whose first call imported torch._prims & co, 2.0 of a
        # demo replica's 5.7 s to its first answer (make bench-ready)
        self.register_buffer("triu", torch.triu_indices(feats, feats, offset=1, device="cpu"))
        over_in = width if self.dcn_layers else dim + feats * (feats - 1) // 2
        sizes = [over_in, *spec["over_arch"]]
        self.over = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(sizes))

    def pooled(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """Sum-pooled embeddings ``[B, F, E]`` of the raw ids (hashed ``id mod rows``)."""
        batch = lengths.shape[1]
        lens = lengths.reshape(-1).to(torch.int64)  # bags, feature-major: f * B + b
        ends = torch.cumsum(lens, 0)
        if self.scatter:
            # bag of each id = number of bag ends at or before its position
            n = values.shape[0]
            marks = torch.zeros(n + 1, dtype=torch.int64, device=values.device)
            marks = marks.index_add(0, ends, torch.ones_like(ends))
            bag = torch.cumsum(marks, 0)[:n]
            feature = torch.div(bag, batch, rounding_mode="floor")
            ids = hash_ids(values, self.rows[feature]) + self.row_offsets[feature]
            rows = self.weight[ids]
            out = torch.zeros(lens.shape[0], self.dim, dtype=rows.dtype, device=rows.device)
            out = out.index_add(0, bag, rows)
        else:
            base = torch.repeat_interleave(self.row_offsets, lengths.to(torch.int64).sum(dim=1))
            ids = hash_values(values, lengths, self.rows) + base
            out = F.embedding_bag(ids, self.weight, ends - lens, mode="sum")
        return out.reshape(self.num_features, batch, self.dim).transpose(0, 1)

    def forward(
        self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        x = dense_transform(dense).to(self.weight.dtype)
        for layer in self.dense:
            x = torch.relu(layer(x))
        combined = torch.cat((x.unsqueeze(1), self.pooled(values, lengths)), dim=1)  # [B,F+1,E]
        if self.dcn_layers:
            x0 = combined.reshape(combined.shape[0], -1)
            y = x0
            for i in range(self.dcn_layers):
                y = x0 * (F.linear(F.linear(y, self.dcn_v[i]), self.dcn_w[i]) + self.dcn_b[i]) + y
        else:
            inter = torch.bmm(combined, combined.transpose(1, 2))
            y = torch.cat((x, inter[:, self.triu[0], self.triu[1]]), dim=1)
        last = len(self.over) - 1
        for i, layer in enumerate(self.over):
            y = layer(y)
            if i < last:
                y = torch.relu(y)
        return torch.sigmoid(y.float()).squeeze(-1)


def from_state(state: dict[str, Any], bags: str = "embedding_bag") -> PortableScorer:
    """Rebuild a scorer from :func:`to_state`'s dict (``torch.load`` of ``portable_state.pt``)."""
    model = PortableScorer(state["spec"], bags=bags)
    model.load_state_dict(state["weights"])
    return model.eval()


def to_state(model: PortableScorer) -> dict[str, Any]:
    """Plain tensors and the spec: what ``torch.save`` stores, readable by any torch version."""
    return {"spec": model.spec, "weights": {k: v.clone() for k, v in model.state_dict().items()}}
