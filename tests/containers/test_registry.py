"""``make push`` against a real registry (Debian's docker-registry on a free port, plain HTTP):
the gateway image tagged ``REGISTRY/recsys-gateway:<project version>`` and pushed, the digest
printed, the local tag removed, the image pulled back by that digest: the same image, and it
runs (the gateway's ``--help``, in a container started by the digest). The
compose variables push prints (RECSYS_IMAGE_PREFIX, RECSYS_IMAGE_TAG) make ``docker-compose
config`` name exactly the pushed images (no engine needed: Compose 1.29 interpolates).

The image pushed is ``recsys-stack/gateway:$IMAGE_TAG`` (latest unless the environment says, as
``make images`` / ``make push`` read it)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from recsys_stack.net import free_ports
from tests.containers.conftest import COMPOSE_FILE, ROOT, _run
from tests.deploy.test_compose import EXTERNAL_IMAGES, PROFILES, clean_env, compose_bin

pytestmark = pytest.mark.slow
TAG = os.environ.get("IMAGE_TAG") or "latest"
LOCAL = f"recsys-stack/gateway:{TAG}"


def compose_images(line: str) -> dict[str, str]:
    """Each service's image as ``docker-compose config`` resolves it (every profile) with the
    variables of make push's ``compose:`` line."""
    assigned = [w.split("=", 1) for w in shlex.split(line) if re.fullmatch(r"RECSYS_\w+=.*", w)]
    proc = subprocess.run(
        [compose_bin(), "-f", str(COMPOSE_FILE), *[a for p in PROFILES for a in ("--profile", p)],
         "config"], cwd=ROOT, env={**clean_env(), **dict(assigned)}, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "is not set" not in proc.stderr, proc.stderr
    return {n: s["image"] for n, s in yaml.safe_load(proc.stdout)["services"].items()}


def test_push_then_pull_by_digest_gives_the_same_image(tmp_path: Path) -> None:
    registry = shutil.which("docker-registry")
    if registry is None or shutil.which("podman") is None:
        pytest.fail("no docker-registry or podman: run `make container-deps`")
    if _run(["podman", "image", "exists", LOCAL]).returncode:
        pytest.fail(f"{LOCAL} not built: run `make images`")
    (port,) = free_ports(1)
    config = tmp_path / "registry.yml"
    config.write_text(
        f"version: 0.1\nstorage:\n  filesystem:\n    rootdirectory: {tmp_path / 'data'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n"
    )
    served = subprocess.Popen([registry, "serve", str(config)], stdout=subprocess.DEVNULL,
                              stderr=(tmp_path / "registry.log").open("w"))  # fmt: skip
    host = f"127.0.0.1:{port}"
    pulled = ""
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://{host}/v2/", timeout=5).close()
                break
            except OSError:
                assert served.poll() is None, (tmp_path / "registry.log").read_text()
                assert time.monotonic() < deadline, "the registry did not answer in 60 s"
                time.sleep(0.5)
        push = subprocess.run(
            ["make", "--no-print-directory", "push", f"REGISTRY={host}",
             "REGISTRY_TLS_VERIFY=false", "IMAGE_TARGETS=gateway"],
            cwd=ROOT, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert push.returncode == 0, push.stdout + push.stderr
        version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
        assert version is not None
        tag = f"{host}/recsys-gateway:{version[1]}"
        (line,) = [ln for ln in push.stdout.splitlines() if ln.startswith(tag)]
        pulled = line.split()[1]
        assert re.fullmatch(rf"{re.escape(host)}/recsys-gateway@sha256:[0-9a-f]{{64}}", pulled)
        # compose runs what was pushed, unchanged: every image of ours under the registry's
        # names (the gateway's the very tag pushed), Prometheus's own unless pushed too
        (env_line,) = [ln for ln in push.stdout.splitlines() if ln.startswith("compose: ")]
        images = compose_images(env_line)
        assert images["gateway"] == images["folders"] == tag, images
        ours = {f"{host}/recsys-{t}:{version[1]}"
                for t in ("trainer", "torchserve", "torchserve-cuda", "gateway", "locust")}  # fmt: skip
        assert set(images.values()) == ours | {EXTERNAL_IMAGES["prometheus"]}, images
        local = _run(["podman", "image", "inspect", "--format", "{{.Id}}", LOCAL]).stdout.strip()
        assert _run(["podman", "rmi", tag]).returncode == 0  # the pushed tag gone here
        got = _run(["podman", "pull", "-q", "--tls-verify=false", pulled], timeout=600)
        assert got.returncode == 0, got.stderr
        again = _run(["podman", "image", "inspect", "--format", "{{.Id}}", pulled]).stdout.strip()
        assert again == local, (again, local)
        # and it runs by that digest: the gateway's entry point, in a container of its own
        ran = _run(["podman", "run", "--rm", "--network", "none", pulled, "python", "-m",
                    "serving.gateway", "--help"], timeout=300)  # fmt: skip
        assert ran.returncode == 0 and "usage" in ran.stdout.lower(), ran.stdout + ran.stderr
    finally:
        if pulled:
            _run(["podman", "rmi", pulled])
        served.terminate()
        served.wait(timeout=30)
