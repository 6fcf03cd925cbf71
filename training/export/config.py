"""The export's config (``ExportConfig``: ``--config FILE.toml``, a flag per field, key=value)
and what it may name: torch-free, so that ``recsys-export --help`` answers before the pipeline
imports torch, TorchRec and fbgemm (training/launch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from training.errors import ConfigError

Format = Literal["int8", "int4", "fp16", "fp32", "torchscript", "portable", "pt2", "onnx", "aoti"]
DEFAULT_FORMATS: tuple[Format, ...] = ("int8", "fp16", "fp32")
# the variants (schema.json's ``variants`` keys) each format writes
FORMAT_VARIANTS: dict[str, tuple[str, ...]] = {
    "int8": ("int8",), "int4": ("int4",), "fp16": ("fp16",), "fp32": ("fp32",),
    "torchscript": ("ts_fp32", "ts_int8"), "portable": ("portable", "portable_fp16"),
    "pt2": ("portable_pt2",), "onnx": ("portable_onnx",), "aoti": ("portable_aoti",),
}  # fmt: skip


@dataclass
class ExportConfig:
    """What to export and where (``--config FILE.toml``, a flag per field, or key=value)."""

    run_dir: Path | None = None
    """Run directory whose checkpoints/latest is exported."""
    checkpoint: Path | None = None
    """A step directory instead of the run's latest, or ``best`` (the run's best by held-out
    metric: checkpoints/best) or ``latest`` with run_dir."""
    formats: list[Format] = field(default_factory=lambda: list(DEFAULT_FORMATS))
    """What to write (any of: int8, int4, fp16, fp32, torchscript, portable, pt2, onnx, aoti).
    Streamed table by table from the checkpoint (peak memory about the largest table):
    ``int8`` (tables mapped by CPU workers, byte-rowwise int8), ``int4`` (mapped like int8,
    4-bit rowwise: half its bytes, more error; the embedding dim must be even), ``fp16``
    (what CUDA workers copy to their device), ``fp32`` (the model as trained: the parity reference, written
    always, not archived). On request, from the whole model in memory (about 3x the fp32
    tables at peak): ``torchscript`` (TorchRec's TorchScript fp32 + int8; loading needs
    fbgemm), ``portable`` (torch-only TorchScript fp32 + fp16, ``portable_state.pt``), ``pt2``
    (a ``torch.export`` program), ``onnx``, ``aoti`` (AOTInductor for this machine: a C++
    compile, ~1 min at the criteo-kaggle shape)."""
    name: str = ""
    """Model name (default: dlrm-<preset>, refused when model_store holds it from another
    run: a name given here is the user's to share)."""
    version: str = ""
    """Model version (default: the checkpoint's step)."""
    model_store: Path = Path("model_store")
    """Where the .mar goes."""
    handler: Path = Path("serving/worker/handler.py")
    """TorchServe handler archived with the model (its codec.py and scoring.py beside it)."""
    parity_rows: int = 20_000
    """Held-out rows for the parity check (the run's eval split unless eval_data), each
    scored once by every variant: its cost is rows x variants (printed in the report)."""
    unserved_parity_rows: int = 2_000
    """Rows (the first of the parity rows) on which variants this machine does not serve are
    checked: the fp16 tables on a machine without CUDA (CUDA workers load them; fp16 on a CPU
    scored 20,000 rows in 391 s of a 488 s demo export). Their ``|ΔAUC|`` is against the
    reference on the same rows; 0 = all the parity rows."""
    latency: bool = False
    """Also time every variant in-process (p50/p99 at batch 1, 100 and 512, 50 rounds; always
    when cpu_variant = fastest). Off by default: at the criteo-kaggle shape it took 146 s of
    a 254 s export, and a shared machine's load moves it 3x (docs/export.md)."""
    eval_data: Path | None = None
    """A Criteo TSV to check parity on instead of the run's eval split (or ``unseen_data``)."""
    unseen_data: Path | None = None
    """A Criteo TSV none of whose rows the checkpoint trained on (the continuous loop passes
    the file that arrived after it): schema.json records it as the version's unseen rows, the
    default rows of make score / evaluate / rollout, and parity is checked on it (unless
    ``eval_data``). Without it, a batch run's unseen rows are its held-out split."""
    force: bool = False
    """Export even when parity fails (recorded in parity.json and schema.json)."""
    overwrite: bool = False
    """Replace an existing <name>-<version>.mar."""
    archive: bool = True
    """Build the .mar (off: only the export directory)."""
    progress: bool = True
    """Progress bars while the parity rows are generated or preprocessed."""
    eager_check_bytes: int = 256 << 20
    """Also score the parity rows with TorchRec's own eager model (it holds every table in
    memory, about 3x their bytes at peak) when the fp32 tables are at most this many bytes;
    larger models are checked against the streamed fp32 tables (the trained weights, and the
    suite checks the portable scorer's math against TorchRec's on small models)."""
    cpu_variant: str = "int8"
    """What CPU workers serve (the .mar's file): a written variant (int8, fp32, ts_int8,
    portable, ...) or ``fastest`` (the fastest measured at batch 100 among those passing
    parity)."""
    memory_budget: int = 0
    """Bytes the CPU workers' tables may take (0: no budget). When given, the export also
    writes ``mixed``: each table in fp16, int8 or int4, lowered in the order of least
    measured loss per byte saved on the parity rows until the tables fit (schema.json's
    ``memory_budget`` records each table's choice and losses), and CPU workers serve it unless
    cpu_variant names another than int8. Refused below the all-int4 size (which it names)."""
    cuda_dtype: Literal["fp16", "bf16", "fp32"] = "fp16"
    """Precision a CUDA worker serves the portable scorer in (recorded in schema.json; the
    handler's RECSYS_CUDA_DTYPE overrides it)."""
    cuda_int8: bool = False
    """Also build int8 tables with CUDA kernels (16-byte rows): needs a GPU and the CUDA
    fbgemm wheel."""

    def validate(self) -> None:
        """Raise ConfigError when the config names no checkpoint."""
        if self.run_dir is None and self.checkpoint is None:
            raise ConfigError("give --run-dir or --checkpoint (run_dir / checkpoint)")
        # what a TorchServe worker can load (onnx needs onnxruntime, aoti this machine's build)
        named = (
            {v for f in self.formats if f not in ("onnx", "aoti") for v in FORMAT_VARIANTS[f]}
            | {"fastest"}
            | ({"mixed"} if self.memory_budget > 0 else set())
        )
        if self.memory_budget < 0:
            raise ConfigError(f"memory_budget = {self.memory_budget}: give bytes, or 0 for none")
        if self.cpu_variant not in named:
            raise ConfigError(
                f"cpu_variant = {self.cpu_variant}: the formats written give "
                f"{', '.join(sorted(named))}"
            )
        if self.cuda_int8:
            import torch

            check_cuda_int8(torch.cuda.is_available())


def check_cuda_int8(cuda_available: bool) -> None:
    """Raise ConfigError unless int8 CUDA embedding kernels can be built here."""
    from importlib import metadata

    if not cuda_available:
        raise ConfigError("cuda_int8 needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        metadata.distribution("fbgemm-gpu")  # the CUDA build; the CPU one is fbgemm-gpu-cpu
    except metadata.PackageNotFoundError:
        raise ConfigError(
            "cuda_int8 needs the CUDA fbgemm wheel: pip install fbgemm-gpu==1.8.0 "
            "(it replaces fbgemm-gpu-cpu; built for torch 2.13)"
        ) from None
    # Never run on a machine with both (docs/bench.md): refuse rather than ship it untested.
    raise ConfigError("cuda_int8: the CUDA int8 build is not implemented yet; serve portable_fp16")
