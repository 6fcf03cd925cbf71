"""Shared helpers: run the real entry points (torchrun process groups) as subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def run_train(
    args: list[str],
    nproc: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc_per_node=nproc -m training.train args`` (plain python for nproc=0)."""
    if nproc == 0:
        cmd = [sys.executable, "-m", "training.train", *args]
    else:
        cmd = [
            str(VENV_BIN / "torchrun"),
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "training.train",
            *args,
        ]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=_env(env), capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stderr (tail) ---\n{proc.stderr[-4000:]}"
        )
    return proc


@pytest.fixture(scope="session")
def data_dirs(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Overrides that put synthetic data and binary caches in one session-wide temp folder."""
    base = tmp_path_factory.mktemp("data")
    return [f'data.cache_dir="{base / "cache"}"', f'data.synthetic_dir="{base / "synthetic"}"']
