"""The model under test and the requests sent to it.

Without an export, :func:`build_model` trains the criteo-kaggle preset's model (MLPs
13-512-256-64-16 / 512-256-1, dim 16) with tables capped at ``max_rows`` rows for 3 steps on
synthetic data and exports it, in subprocesses: serving never imports training. :func:`payload`
turns the export's ``sample.npz`` rows into one request of ``B`` examples in every method's
wire format, built once so that the clients measure the servers, not the request builders.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from serving.stubs import ranker_pb2
from serving.tools.client import build_request
from serving.torchserve.client import inference_pb2, predictions_request
from serving.worker.codec import encode_request, to_rows

ROOT = Path(__file__).resolve().parents[2]
KAGGLE_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
               27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]  # fmt: skip


def build_model(workdir: Path, max_rows: int) -> tuple[Path, Path]:
    """Train criteo-kaggle-shaped for 3 steps and export it; ``(export dir, model store)``."""
    capped = [min(r, max_rows) for r in KAGGLE_ROWS]
    run, store = workdir / "run", workdir / "store"
    data = [f'data.cache_dir="{workdir / "cache"}"', f'data.synthetic_dir="{workdir / "syn"}"']
    steps = [
        ["training.train", "--config", "training/configs/criteo-kaggle.toml", "--run-dir", str(run),
         "--no-progress", "--resume", "none", "train.max_steps=3", "train.batch_size=1024",
         "data.synthetic_rows=40000", f"model.num_embeddings={capped}", *data],
        ["training.export", "--run-dir", str(run), "--no-progress", "--model-store", str(store),
         "--name", "bench", "--version", "1", "--parity-rows", "4000",
         "--formats", '["int8", "fp16", "fp32", "torchscript"]'],
    ]  # fmt: skip
    run_modules(steps)
    return run / "export", store


def run_modules(steps: list[list[str]]) -> None:
    """``python -m step`` for each step in turn, in the repository; RuntimeError with the tail
    of its stderr at the first that fails."""
    for args in steps:
        proc = subprocess.run(
            [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True
        )
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.splitlines()[-15:])
            raise RuntimeError(f"python -m {args[0]} exited {proc.returncode}:\n{tail}")


@dataclass(frozen=True)
class Model:
    """What the benchmark needs from an export: its schema and the artifact the .mar serves."""

    export: Path
    schema: dict[str, Any]

    @classmethod
    def load(cls, export: Path) -> Model:
        return cls(export, json.loads((export / "schema.json").read_text()))

    @property
    def name(self) -> str:
        return str(self.schema["model"]["name"])

    @property
    def version(self) -> str:
        return str(self.schema["model"]["version"])

    @property
    def artifact(self) -> Path:
        """The file the .mar serves (``mapped_int8.pt`` by default)."""
        return self.export / self.variant["file"]

    @property
    def variant(self) -> dict[str, Any]:
        """The served variant's schema record (what loading it needs)."""
        return dict(self.schema["variants"][self.schema["served_variant"]])

    @property
    def plain_artifact(self) -> Path:
        """The TorchScript file plain TorchServe serves (its users' way: BaseHandler and
        ``torch.jit.load``): TorchRec's int8 (``torchscript`` format), else the portable fp32
        (``portable``); an export with neither cannot be the peer's."""
        variants = self.schema["variants"]
        for name in ("ts_int8", "portable"):
            if name in variants:
                return self.export / variants[name]["file"]
        raise RuntimeError(
            f"{self.export} has no TorchScript variant for plain TorchServe: export with "
            '--formats \'["int8", "fp16", "fp32", "torchscript"]\''
        )


@dataclass(frozen=True)
class Payload:
    """One request of ``examples`` examples in each method's format."""

    examples: int
    dense: np.ndarray  # float32[B, 13]
    values: np.ndarray  # int64[N], feature-major
    lengths: np.ndarray  # int32[26, B]
    plain_json: bytes  # {"instances": [{"dense": [13 floats], "sparse": [26 ids, -1 = missing]}]}
    predictions: inference_pb2.PredictionsRequest  # RSB1 body, TorchServe gRPC
    score: ranker_pb2.ScoreRequest  # the gateway's recsys.v1 request


def payload(model: Model, examples: int) -> Payload:
    """Rows of the export's sample, repeated as needed to make ``examples`` of them."""
    s = np.load(model.export / "sample.npz")
    rows = np.arange(examples) % s["dense"].shape[0]
    dense = np.ascontiguousarray(s["dense"][rows], dtype=np.float32)
    sparse = to_rows(s["values"], s["lengths"])[rows]  # int64[B, 26], -1 = missing
    present = sparse >= 0
    values = sparse.T[present.T]
    lengths = present.T.astype(np.int32)
    instances = [
        {"dense": d, "sparse": i} for d, i in zip(dense.tolist(), sparse.tolist(), strict=True)
    ]
    body = encode_request(dense, values, lengths)
    return Payload(
        examples=examples,
        dense=dense,
        values=values,
        lengths=lengths,
        plain_json=json.dumps({"instances": instances}).encode(),
        predictions=predictions_request(model.name, model.version, body),
        score=build_request(dense, sparse),
    )
