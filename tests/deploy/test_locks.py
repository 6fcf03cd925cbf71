"""The images' locks (``make lock``) against the whole lock the suite's venv is built from.

Each image installs a lock of its own with ``--require-hashes --no-deps``: the trainer and
TorchServe ``requirements/torch.lock.txt`` (extras ``train`` + ``serve``), the gateway
``serve.lock.txt``, Locust ``load.lock.txt``. Each must pin the versions and hashes of
``requirements/lock.txt`` (what the suite tests), hold every package its extras name (``--no-deps``
installs nothing else) and, for the torch images, none of the dev tools.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQS = ROOT / "requirements"
IMAGE_LOCKS = {"torch.lock.txt": ("train", "serve"), "serve.lock.txt": ("serve",),
               "load.lock.txt": ("load",)}  # fmt: skip
# installed apart from the lock (make setup, the Dockerfile's torch-deps): requirements/device-cpu.txt
DEVICE = {"torch"}


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(path: Path) -> dict[str, tuple[str, frozenset[str]]]:
    """Distribution -> (version, its hashes), as uv writes a hashed lock."""
    out: dict[str, tuple[str, frozenset[str]]] = {}
    for block in re.split(r"\n(?=[A-Za-z0-9])", path.read_text()):
        m = re.match(r"([A-Za-z0-9][\w.-]*)==(\S+)", block)
        if m:
            out[norm(m[1])] = (m[2], frozenset(re.findall(r"--hash=(sha256:[0-9a-f]{64})", block)))
    return out


def extra_names(*extras: str) -> set[str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {norm(re.split(r"[^A-Za-z0-9_.-]", d, maxsplit=1)[0]) for e in extras for d in deps[e]}


@pytest.mark.parametrize("lock", IMAGE_LOCKS)
def test_an_image_lock_pins_what_lock_txt_pins_and_what_its_extras_name(lock: str) -> None:
    whole, image = pins(REQS / "lock.txt"), pins(REQS / lock)
    assert image and all(hashes for _, hashes in image.values()), f"{lock}: not a hashed lock"
    differ = sorted(n for n, v in image.items() if whole.get(n) != v)
    assert not differ, (
        f"{lock}: versions or hashes other than lock.txt's (run `make lock`): {differ}"
    )
    missing = extra_names(*IMAGE_LOCKS[lock]) - DEVICE - set(image)
    assert not missing, f"{lock} lacks {sorted(missing)} (run `make lock`)"


def test_the_torch_images_lock_holds_no_dev_tool() -> None:
    # the dev extra names these too, but torch itself requires them
    torch_needs = {"setuptools", "filelock"}
    tools = extra_names("dev") - extra_names("train", "serve") - torch_needs
    assert tools >= {"pytest", "ruff", "mypy", "uv", "tritonclient", "kubernetes-validate"}
    found = tools & set(pins(REQS / "torch.lock.txt"))
    assert not found, f"dev tools in torch.lock.txt: {sorted(found)}"
