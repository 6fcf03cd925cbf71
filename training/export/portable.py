"""The portable variants: the trained weights in a pure-PyTorch scorer that loads with torch alone.

:func:`portable_scorer` copies a TorchRec DLRM's tables (into one ``[sum(rows), E]`` weight)
and MLPs into :class:`recsys_model.portable_model.PortableScorer`; :func:`save_portable` writes
it as

* ``model_portable.pt`` / ``model_portable_fp16.pt``: TorchScript, fp32 / fp16 weights;
* ``model_portable.pt2``: a ``torch.export`` program (dynamic batch), fp32;
* ``model_portable_aoti.pt2``: the same, AOTInductor-compiled for this machine's device
  (the ``aoti`` format: ~1 min of C++ compile for the criteo shape; needs a C++ compiler);
* ``model_portable.onnx`` (``training/export/onnx_export.py``);
* ``portable_state.pt``: the spec and plain weights (``torch.save``), from which any torch
  version rebuilds the module (``serving.tools.gpu_check`` does on a CUDA machine).

None of them needs TorchRec or fbgemm to load; :func:`load_variant` loads each kind.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recsys_model.portable_model import PortableScorer, to_state
from training.errors import ConfigError
from training.features import NUM_DENSE, SPARSE_NAMES, table_name

logger = logging.getLogger("training.export")
Model = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
STATE_FILE = "portable_state.pt"
EBC = "sparse_arch.embedding_bag_collection.embedding_bags"
# variant -> (file, what loads it, reduced precision)
PORTABLE = {
    "portable": ("model_portable.pt", "torchscript", False),
    "portable_fp16": ("model_portable_fp16.pt", "torchscript", True),
    "portable_pt2": ("model_portable.pt2", "torch.export", False),
    "portable_aoti": ("model_portable_aoti.pt2", "aoti", False),
    "portable_onnx": ("model_portable.onnx", "onnx", False),
}


def spec_of(model_cfg: Any) -> dict[str, Any]:
    """The training config's model shape, as the portable scorer's ``spec``."""
    return {
        "rows": list(model_cfg.rows()),
        "dim": model_cfg.embedding_dim,
        "num_dense": NUM_DENSE,
        "dense_arch": list(model_cfg.dense_arch),
        "over_arch": list(model_cfg.over_arch),
        "arch": model_cfg.arch,
        "dcn_num_layers": model_cfg.dcn_num_layers,
        "dcn_low_rank_dim": model_cfg.dcn_low_rank_dim,
    }


def _linears(module: nn.Module) -> list[nn.Linear]:
    return [m for m in module.modules() if isinstance(m, nn.Linear)]


def portable_scorer(dlrm: Any, model_cfg: Any, bags: str = "embedding_bag") -> PortableScorer:
    """A :class:`PortableScorer` holding a copy of ``dlrm``'s trained weights (eval mode)."""
    scorer = PortableScorer(spec_of(model_cfg), bags=bags)
    state = dlrm.state_dict()
    with torch.no_grad():
        tables = [state[f"{EBC}.{table_name(f)}.weight"] for f in SPARSE_NAMES]
        scorer.weight.copy_(torch.cat(tables))
    copy_dense(dlrm, scorer)
    return scorer.eval()


def copy_dense(dlrm: Any, scorer: PortableScorer) -> None:
    """``dlrm``'s MLPs (and DCN cross layers) into ``scorer``: everything but the tables."""
    with torch.no_grad():
        pairs = [
            (_linears(dlrm.dense_arch), _linears(scorer.dense)),
            (_linears(dlrm.over_arch), _linears(scorer.over)),
        ]
        for src, dst in pairs:
            if len(src) != len(dst):
                raise ConfigError(
                    f"model has {len(src)} linear layers where its config gives {len(dst)}"
                )
            for s, d in zip(src, dst, strict=True):
                d.weight.copy_(s.weight)
                d.bias.copy_(s.bias)
        if scorer.dcn_layers:
            cross = dlrm.inter_arch.crossnet
            for i in range(scorer.dcn_layers):
                scorer.dcn_v[i].copy_(cross.V_kernels[i])
                scorer.dcn_w[i].copy_(cross.W_kernels[i])
                scorer.dcn_b[i].copy_(cross.bias[i])


def _export_program(scorer: PortableScorer, example: tuple[torch.Tensor, ...]) -> Any:
    """``torch.export`` with a dynamic batch (B) and a dynamic id count (N)."""
    batch, ids = torch.export.Dim("batch", min=1), torch.export.Dim("ids", min=0)
    shapes = {"dense": {0: batch}, "values": {0: ids}, "lengths": {1: batch}}
    return torch.export.export(scorer, example, dynamic_shapes=shapes, strict=False)


def save_portable(
    scorer: PortableScorer, out: Path, example: tuple[torch.Tensor, ...], formats: set[str]
) -> dict[str, Path]:
    """Write the portable variants of ``scorer`` that ``formats`` names into ``out``:
    ``portable`` (TorchScript fp32 + fp16, and ``portable_state.pt``), ``pt2``, ``aoti`` (from
    the pt2 program) and ``onnx``; returns ``{variant: path}``."""
    files: dict[str, Path] = {}
    if "portable" in formats:
        torch.save(to_state(scorer), out / STATE_FILE)
        for name, dtype in (("portable", torch.float32), ("portable_fp16", torch.float16)):
            scripted = torch.jit.script(_copy(scorer).to(dtype))
            files[name] = out / PORTABLE[name][0]
            scripted.save(str(files[name]))  # type: ignore[no-untyped-call]
    if formats & {"pt2", "aoti"}:
        program = _export_program(scorer, example)
    if "pt2" in formats:
        files["portable_pt2"] = out / PORTABLE["portable_pt2"][0]
        torch.export.save(program, files["portable_pt2"])
    if "aoti" in formats:
        if shutil.which("c++") is None and shutil.which("g++") is None:
            raise ConfigError("the aoti format needs a C++ compiler (apt-get install g++)")
        from torch._inductor import aoti_compile_and_package

        files["portable_aoti"] = out / PORTABLE["portable_aoti"][0]
        aoti_compile_and_package(program, package_path=str(files["portable_aoti"]))
    if "onnx" in formats:
        from training.export.onnx_export import export_onnx

        files["portable_onnx"] = out / PORTABLE["portable_onnx"][0]
        export_onnx(scorer, example, files["portable_onnx"])
    return files


def _copy(scorer: PortableScorer) -> PortableScorer:
    from recsys_model.portable_model import from_state

    return from_state(to_state(scorer), bags="scatter" if scorer.scatter else "embedding_bag")


def load_variant(path: Path, kind: str) -> Model:
    """Load a saved portable variant (CPU) as a ``(dense, values, lengths) -> probs`` callable."""
    if kind == "torchscript":
        return torch.jit.load(str(path))  # type: ignore[no-untyped-call,no-any-return]
    if kind == "torch.export":
        return torch.export.load(path).module()  # type: ignore[no-any-return]
    if kind == "aoti":
        from torch._inductor import aoti_load_package

        return aoti_load_package(str(path))  # type: ignore[no-any-return]
    if kind == "onnx":
        from training.export.onnx_export import OnnxScorer

        return OnnxScorer(path)
    raise ValueError(f"unknown variant kind {kind!r}")
