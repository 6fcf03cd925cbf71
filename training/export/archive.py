"""Archive an export directory as a versioned TorchServe ``.mar`` in the model store.

``model_store/<name>-<version>.mar``: several versions live side by side (TorchServe reads the
name and version from the archive's manifest). The archive is built in a temporary folder and
moved into place in one rename, so a failure leaves nothing half-written; an existing version
is replaced only with ``overwrite``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from training.errors import ConfigError, RecsysError

_VERSION = re.compile(r"^[0-9A-Za-z][0-9A-Za-z._-]*$")


def mar_path(store: Path, name: str, version: str) -> Path:
    return store / f"{name}-{version}.mar"


def check_target(store: Path, name: str, version: str, overwrite: bool) -> Path:
    """Validate name/version and refuse to clobber an existing version (before any work)."""
    for what, value in (("name", name), ("version", version)):
        if not _VERSION.match(value):
            raise ConfigError(f"model {what} '{value}': use letters, digits, '.', '_' or '-'")
    target = mar_path(store, name, version)
    if target.exists() and not overwrite:
        raise ConfigError(
            f"{target} exists: pick another --version, or pass --overwrite to replace it"
        )
    return target


def archive(
    export_dir: Path,
    artifact: str,
    handler: Path,
    extra_files: list[Path],
    store: Path,
    name: str,
    version: str,
    overwrite: bool,
) -> Path:
    """Run torch-model-archiver; returns the .mar path."""
    target = check_target(store, name, version, overwrite)
    if not handler.is_file():
        raise ConfigError(f"handler not found: {handler} (set --handler)")
    store.mkdir(parents=True, exist_ok=True)
    archiver = Path(sys.executable).parent / "torch-model-archiver"
    with tempfile.TemporaryDirectory(dir=store, prefix=".archive-") as tmp:
        cmd = [
            str(archiver if archiver.exists() else "torch-model-archiver"),
            "--model-name", name,
            "--version", version,
            "--serialized-file", str(export_dir / artifact),
            "--handler", str(handler),
            "--extra-files", ",".join(str(p) for p in extra_files),
            "--export-path", tmp,
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise RecsysError(f"torch-model-archiver failed: {last}")
        built = Path(tmp) / f"{name}.mar"
        os.replace(built, target)
    return target


def remove_quietly(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()
