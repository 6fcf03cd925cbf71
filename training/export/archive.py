"""Archive an export directory as a versioned TorchServe ``.mar`` in the model store.

``model_store/<name>-<version>.mar``: several versions live side by side (TorchServe reads the
name and version from the archive's manifest). The archive is built in a temporary folder and
moved into place in one rename, so a failure leaves nothing half-written; an existing version
is replaced only with ``overwrite``.

A ``.mar`` is a zip with ``MAR-INF/MANIFEST.json`` (what ``torch-model-archiver`` writes). We
write it ourselves because the archiver deflates every file: for the Kaggle shape that was ~2
minutes of compression of 3.7 GB for 8% savings, and TorchServe inflates it again at every
registration. Weights (``.bin``, ``.pt``, ``.pt2``, ``.onnx``) are stored as they are, so
archiving costs one copy and unpacking one more, at disk speed; text is deflated.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

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


def check_owner(store: Path, name: str, run_dir: Path) -> None:
    """Refuse a default model name that ``store`` holds from another run (schema.json's
    ``source.run_dir``, else the run of its ``source.checkpoint``), or from a run it cannot
    tell: two runs' models under one name would be versions of one model, each rollable over
    the other. A name the user gives (``--name``) is theirs to reuse."""
    here = run_dir.resolve()
    for mar in sorted(store.glob(f"{name}-*.mar")):
        try:
            with zipfile.ZipFile(mar) as z:
                if json.loads(z.read("MAR-INF/MANIFEST.json"))["model"]["modelName"] != name:
                    continue  # another model whose name starts with this one
                source = json.loads(z.read("schema.json")).get("source", {})
        except (OSError, KeyError, ValueError, zipfile.BadZipFile) as e:
            raise ConfigError(
                f"{mar}: cannot tell which run it is from ({e}); pass --name (make export "
                f"NAME=dlrm-{run_dir.name}) to name this run's model yourself"
            ) from None
        owner = source.get("run_dir") or (
            str(Path(source["checkpoint"]).parent.parent) if source.get("checkpoint") else ""
        )
        if Path(owner) != here:
            raise ConfigError(
                f"{mar} is {name} from another run ({owner or 'not recorded'}), not {here}: "
                f"pass --name (make export NAME=dlrm-{run_dir.name}) so the two models stay apart"
            )


STORED = (".bin", ".pt", ".pt2", ".onnx", ".data")  # already dense: deflate saves little
ARCHIVER_VERSION = "0.12.0"  # the torch-model-archiver whose manifest this one matches


def manifest(name: str, version: str, serialized: str, handler: str) -> dict[str, Any]:
    """``MAR-INF/MANIFEST.json`` as torch-model-archiver 0.12 writes it."""
    return {
        "createdOn": time.strftime("%d/%m/%Y %H:%M:%S"),
        "runtime": "python",
        "model": {
            "modelName": name, "serializedFile": serialized, "handler": handler,
            "modelVersion": version,
        },
        "archiverVersion": ARCHIVER_VERSION,
    }  # fmt: skip


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
    """Write ``store/<name>-<version>.mar`` (flat: every file at the top, as TorchServe puts
    them beside the handler); returns its path."""
    target = check_target(store, name, version, overwrite)
    if not handler.is_file():
        raise ConfigError(f"handler not found: {handler} (set --handler)")
    files = [export_dir / artifact, handler, *extra_files]
    missing = [str(p) for p in files if not p.is_file()]
    if missing:
        raise ConfigError(f"cannot archive {name} {version}: missing {', '.join(missing)}")
    store.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=store, prefix=".archive-") as tmp:
        built = Path(tmp) / f"{name}.mar"
        try:
            with zipfile.ZipFile(built, "w", allowZip64=True) as z:
                for path in dict.fromkeys(files):  # each file once, in order
                    kind = zipfile.ZIP_STORED if path.suffix in STORED else zipfile.ZIP_DEFLATED
                    z.write(path, path.name, compress_type=kind)
                doc = manifest(name, version, artifact, handler.name)
                info = zipfile.ZipInfo("MAR-INF/MANIFEST.json", time.localtime()[:6])
                info.external_attr = 0o644 << 16
                z.writestr(info, json.dumps(doc, indent=2), compress_type=zipfile.ZIP_DEFLATED)
        except OSError as e:
            raise RecsysError(f"archiving {name} {version} failed: {e}") from None
        os.replace(built, target)
    return target


def remove_quietly(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()
