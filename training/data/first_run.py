"""What a first run will generate and cache, said before torch's import (torch-free)."""

from __future__ import annotations

from pathlib import Path

from training.config import DataConfig

# Measured on the demo preset (4M rows, vocab 1000; 2 cores, quiet): the TSV 1,030 MB (258 B a
# row), the cache 109 B a row; generation 14.5 s + preprocessing 10.9 s.
TSV_BYTES_PER_ROW, CACHE_BYTES_PER_ROW, FIRST_RUN_S_PER_MROW = 258, 109, 6.5


def synthetic_file(cfg: DataConfig) -> Path:
    """The synthetic TSV of ``cfg`` (its name holds rows, vocab and seed: a cache)."""
    name = f"synthetic_r{cfg.synthetic_rows}_v{cfg.synthetic_vocab}_s{cfg.synthetic_seed}"
    return Path(cfg.synthetic_dir) / f"{name}.tsv"


def first_run_note(cfg: DataConfig) -> str | None:
    """What a first run will generate and cache, said before torch's import (seconds of
    silence, minutes on a loaded machine); None once the synthetic file is there or for
    the user's own data."""
    if cfg.path or synthetic_file(cfg).is_file():
        return None
    rows = cfg.synthetic_rows

    def size(b: float) -> str:
        return f"{b / 1e9:.1f} GB" if b >= 1e9 else f"{max(b / 1e6, 1):.0f} MB"

    return (
        f"first run: {rows:,} synthetic rows to generate into {synthetic_file(cfg)} "
        f"(~{size(rows * TSV_BYTES_PER_ROW)}) and preprocess into {cfg.cache_dir} "
        f"(~{size(rows * CACHE_BYTES_PER_ROW)}), once: about "
        f"{max(rows / 1e6 * FIRST_RUN_S_PER_MROW, 1):.0f} s on 2 quiet cores, longer on a "
        f"busy machine"
    )
