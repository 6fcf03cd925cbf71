"""``make push`` against a real registry (Debian's docker-registry on a free port, plain HTTP):
the gateway image tagged ``REGISTRY/recsys-gateway:<project version>`` and pushed, the digest
printed, the local tag removed, the image pulled back by that digest: the same image."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from recsys_stack.net import free_ports
from tests.containers.conftest import ROOT, _run

pytestmark = pytest.mark.slow


def test_push_then_pull_by_digest_gives_the_same_image(tmp_path: Path) -> None:
    registry = shutil.which("docker-registry")
    if registry is None or shutil.which("podman") is None:
        pytest.fail("no docker-registry or podman: run `make container-deps`")
    if _run(["podman", "image", "exists", "recsys-stack/gateway:latest"]).returncode:
        pytest.fail("recsys-stack/gateway:latest not built: run `make images`")
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
        local = _run(["podman", "image", "inspect", "--format", "{{.Id}}",
                      "recsys-stack/gateway:latest"]).stdout.strip()  # fmt: skip
        assert _run(["podman", "rmi", tag]).returncode == 0  # the pushed tag gone here
        got = _run(["podman", "pull", "-q", "--tls-verify=false", pulled], timeout=600)
        assert got.returncode == 0, got.stderr
        again = _run(["podman", "image", "inspect", "--format", "{{.Id}}", pulled]).stdout.strip()
        assert again == local, (again, local)
    finally:
        if pulled:
            _run(["podman", "rmi", pulled])
        served.terminate()
        served.wait(timeout=30)
