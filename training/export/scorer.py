"""The served artifact: raw features in, click probabilities out, as one TorchScript module.

``Scorer`` wraps the pure DLRM with everything between raw features and a probability: the
dense transform, id hashing (``id mod rows`` per table), the model and the sigmoid. The
transforms are ``training.features``' (the training loader's), scripted into the artifact. Its
inputs are plain tensors, so serving needs only ``torch`` and ``import fbgemm_gpu``:

* ``dense``   float32[B, 13]  raw Criteo integer values (missing = 0)
* ``values``  int64[N]        raw ids, grouped by feature in schema order, then by example
* ``lengths`` int32[26, B]    ids per (feature, example); 0 = missing; ``N = lengths.sum()``

Output: float32[B] probabilities. No batch size is baked in (the KJT is built inside from the
lengths, and the quantized variant is FX-traced with the KJT as an input, not from a batch).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torchrec import KeyedJaggedTensor
from torchrec.models.dlrm import DLRM

from training.checkpoint import store as checkpoint
from training.config import Config, config_from_dict
from training.errors import CheckpointError, ConfigError
from training.features import SPARSE_NAMES, dense_transform, hash_values, pack_ids
from training.model import build_dlrm

Variant = Literal["fp32", "int8", "fp16"]
CHECKPOINT_PREFIX = "model.model."
CPU_ROW_ALIGNMENT = 1  # {"model": DMP(DLRMTrain).state_dict()} -> DLRM keys


class Scorer(nn.Module):
    """``(dense f32[B,13], values i64[N], lengths i32[26,B]) -> probabilities f32[B]``."""

    def __init__(self, dlrm: nn.Module, rows: list[int]) -> None:
        super().__init__()
        self.dlrm = dlrm
        self.register_buffer("rows", torch.tensor(rows, dtype=torch.int64))
        self.keys: list[str] = list(SPARSE_NAMES)

    def forward(
        self, dense: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor
    ) -> torch.Tensor:
        ids = hash_values(values, lengths, self.rows)  # type: ignore[arg-type]
        kjt = KeyedJaggedTensor(
            keys=self.keys, values=ids, lengths=lengths.reshape(-1).to(torch.int32)
        )
        return torch.sigmoid(self.dlrm(dense_transform(dense), kjt)).squeeze(-1)


def load_config(ckpt: Path) -> tuple[Config, dict[str, Any]]:
    """A complete checkpoint's training config and meta (no tensor is read)."""
    meta = checkpoint.read_meta(checkpoint.check_complete(ckpt))
    try:
        cfg = config_from_dict(meta["config"])
        cfg.validate()
    except (KeyError, ConfigError) as e:
        raise CheckpointError(f"{ckpt / checkpoint.META}: no usable config ({e})") from None
    return cfg, meta


def load_dlrm(ckpt: Path) -> tuple[DLRM, Config, dict[str, Any]]:
    """The pure DLRM of a (sharded, any world size) checkpoint, whole, on CPU, in eval mode."""
    cfg, meta = load_config(ckpt)
    model = build_dlrm(cfg.model, device="cpu")
    tensors = checkpoint.read_tensors(ckpt, prefix=CHECKPOINT_PREFIX)
    state = {k[len(CHECKPOINT_PREFIX) :]: v for k, v in tensors.items()}
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(
            f"checkpoint {ckpt} lacks '{missing[0]}' (and {len(missing) - 1} more)"
        )
    for key, value in expected.items():
        if state[key].shape != value.shape:
            raise CheckpointError(
                f"checkpoint {ckpt}: '{key}' has shape {list(state[key].shape)} but its "
                f"config gives {list(value.shape)}: the tensors belong to another model"
            )
    model.load_state_dict({k: state[k] for k in expected})
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, cfg, meta


def eager_scorer(dlrm: DLRM, cfg: Config) -> Scorer:
    """The unscripted reference every variant is checked against."""
    return Scorer(dlrm, cfg.model.rows()).eval()


def script_variant(dlrm: DLRM, cfg: Config, variant: Variant) -> torch.jit.ScriptModule:
    """TorchScript of ``Scorer`` with fp32 tables, or int8/fp16 rows via torchrec.inference."""
    if variant == "fp32":
        return torch.jit.script(eager_scorer(copy.deepcopy(dlrm), cfg))
    import torchrec.fx
    from torchrec import EmbeddingBagCollection
    from torchrec.inference.modules import quantize_inference_model
    from torchrec.quant.embedding_modules import quant_prep_customize_row_alignment

    dtype = torch.int8 if variant == "int8" else torch.half
    model = copy.deepcopy(dlrm)
    # TorchRec pads quantized rows to 16 bytes, which CUDA kernels need; fbgemm's CPU kernels
    # take any alignment. An int8 row of dim 16 is 16 B + 4 B scale/bias: 20 B unpadded (3.2x
    # smaller than fp32) but 32 B padded (2x). This artifact targets CPU, so it is unpadded.
    quant_prep_customize_row_alignment(model, [EmbeddingBagCollection], CPU_ROW_ALIGNMENT)
    # Module swap EBC -> QuantEBC: rows are quantized from the trained weights (no re-init;
    # shard_quant_model, which would re-create the tables, is not used for one CPU process).
    quant = quantize_inference_model(model, quantization_dtype=dtype)
    traced = torchrec.fx.symbolic_trace(quant)  # KJT stays an input: no batch size baked in
    scripted: torch.jit.ScriptModule = torch.jit.script(Scorer(traced, cfg.model.rows()).eval())
    return scripted


def resolve_checkpoint(run_dir: Path | None, ckpt: Path | None) -> Path:
    """An explicit checkpoint directory, ``best`` or ``latest`` of the run's checkpoints (what
    that pointer names), else the run's ``latest``."""
    if ckpt is not None and str(ckpt) in checkpoint.POINTERS:
        if run_dir is None:
            raise ConfigError(f"--checkpoint {ckpt} names a run's checkpoint: give --run-dir too")
        return checkpoint.resolve(str(ckpt), run_dir / "checkpoints")  # type: ignore[return-value]
    if ckpt is not None:
        return ckpt
    assert run_dir is not None
    latest = checkpoint.read_latest(run_dir / "checkpoints")
    if latest is None:
        raise CheckpointError(
            f"{run_dir / 'checkpoints'} has no complete checkpoint (no 'latest'): train first"
        )
    return latest


def raw_inputs(dense: Any, sparse: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows as stored (``float32[B,13]`` raw dense, ``int64[B,26]`` raw ids, -1 = missing) ->
    the artifact's ``(dense, values, lengths)``; what a client does with parsed TSV rows."""
    values, lengths = pack_ids(torch.from_numpy(np.array(sparse, dtype=np.int64)))  # copies mmap
    return torch.from_numpy(np.array(dense, dtype=np.float32)), values, lengths
