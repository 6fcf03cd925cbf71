"""deploy/k8s/overlays/podman played for real with ``podman kube play``, rendered as an operator
renders it (``python -m serving.tools.kustomize render``) and played as written: the TorchServe
Deployment (2 replicas) and the gateway Deployment, their ConfigMap, the volumes the overlay's
claims name (created and filled first, as docs/deploy.md says). A client on the host scores
through the gateway's published port and both replicas answer; ``kube down`` and removing
those volumes leave nothing. What podman cannot play (Services, the downward API, probes other
than commands, Secrets as podman 4.3 mounts them) is in the overlay's files, not here; the
schema and policy checks of every overlay are tests/deploy/test_k8s.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from serving.gateway.auth import call_metadata
from serving.stubs import ranker_pb2_grpc
from serving.tools.client import build_request, health
from serving.worker.codec import to_rows
from tests.containers.conftest import ROOT, _run

pytestmark = pytest.mark.slow
OVERLAY = ROOT / "deploy" / "k8s" / "overlays" / "podman"
TOKEN = "kube-play-test-token-" + os.urandom(8).hex()
IMAGES = ("recsys-stack/torchserve", "recsys-stack/gateway", "recsys-python:3.11")
GRPC_PORT, HTTP_PORT = 50051, 8000  # the overlay's hostPorts, on 127.0.0.1
PODS = ("gateway-pod-0", "torchserve-pod-0", "torchserve-pod-1")
SHARED_NETWORK = "podman-default-kube-network"  # podman's own, made by the first kube play


def names(*cmd: str) -> set[str]:
    return set(_run(["podman", *cmd]).stdout.split())


def state() -> dict[str, set[str]]:
    """What podman holds now: pods, containers, volumes, networks, secrets (by name)."""
    return {
        "pods": names("pod", "ps", "--format", "{{.Name}}"),
        "containers": names("ps", "-a", "--format", "{{.Names}}"),
        "volumes": names("volume", "ls", "--format", "{{.Name}}"),
        "networks": names("network", "ls", "--format", "{{.Name}}") - {SHARED_NETWORK},
        "secrets": names("secret", "ls", "--format", "{{.Name}}"),
    }


def require_podman(volumes: list[str]) -> None:
    """Fails (never skips) naming the command that fixes it."""
    if shutil.which("podman") is None:
        pytest.fail("no podman: run `make container-deps images`")
    absent = [i for i in IMAGES if _run(["podman", "image", "exists", i]).returncode]
    if absent:
        pytest.fail(f"images not built: {', '.join(absent)}: run `make images`")
    now = state()
    left = sorted((now["pods"] & set(PODS)) | (now["volumes"] & set(volumes)))
    if left:
        pytest.fail(f"left from an earlier play: {left}: `podman kube down` it, "
                    f"`podman volume rm {' '.join(volumes)}`")  # fmt: skip
    # the overlay publishes the gateway on fixed ports; a test beside this one may hold them
    # for a while (the gateway's defaults): wait for them, then fail naming them
    deadline = time.monotonic() + 180
    while taken := [p for p in (GRPC_PORT, HTTP_PORT) if listening(p)]:
        if time.monotonic() > deadline:
            pytest.fail(
                f"127.0.0.1:{taken} taken for 180 s: the overlay publishes the gateway there"
            )
        time.sleep(2)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def kustomize(*args: str) -> str:
    cmd = [sys.executable, "-m", "serving.tools.kustomize", *args]
    out = _run(cmd, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def kube(exported: tuple[Path, Path, str], tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[Path, list[str], dict[str, set[str]]]]:  # fmt: skip
    """The rendered overlay played on podman; ``kube down`` and the volumes removed after."""
    volumes = kustomize("claims", str(OVERLAY)).split()
    require_podman(volumes)
    export, store, _ = exported
    d = tmp_path_factory.mktemp("kube")
    play = d / "serving.yaml"
    kustomize("render", str(OVERLAY), "-o", str(play))
    before = state()
    base = "localhost/recsys-python:3.11"
    models, keys, token = volumes  # as the overlay's claims name them
    try:
        for v in volumes:
            assert _run(["podman", "volume", "create", v]).returncode == 0
        fill = _run(["podman", "run", "--rm", "-v", f"{models}:/models", "-v", f"{keys}:/keys",
                     "-v", f"{token}:/token", "-v", f"{store}:/src/store:ro",
                     "-v", f"{export}:/src/export:ro", base, "sh", "-c",
                     "mkdir -p /models/model_store /models/export"
                     " && cp /src/store/*.mar /models/model_store/ && cp -r /src/export/. /models/export/"
                     " && chmod -R a+rX /models && chown 1000:1000 /keys"
                     f" && echo {TOKEN} > /token/gateway_token && chown -R 1000:1000 /token"
                     " && chmod 0400 /token/gateway_token"])  # fmt: skip
        assert fill.returncode == 0, fill.stderr
        t0 = time.monotonic()
        up = _run(["podman", "kube", "play", str(play)], timeout=600)
        (d / "play.log").write_text(up.stdout + up.stderr)
        assert up.returncode == 0, up.stderr[-3000:]
        print(f"kube play: {time.monotonic() - t0:.0f} s")
        yield play, volumes, before
    finally:
        _run(["podman", "kube", "down", str(play)], timeout=300)
        _run(["podman", "volume", "rm", "-f", *volumes])


def test_podman_plays_the_serving_manifests_and_a_client_scores(
    kube: tuple[Path, list[str], dict[str, set[str]]], exported: tuple[Path, Path, str]
) -> None:
    play = kube[0]
    try:
        scores_through_the_gateway(play, exported)
    finally:  # the pods' logs, for a failure's post-mortem (kube down removes them)
        for pod in PODS:
            logs = _run(["podman", "pod", "logs", pod])
            (play.parent / f"{pod}.log").write_text(logs.stdout + logs.stderr)


def scores_through_the_gateway(play: Path, exported: tuple[Path, Path, str]) -> None:
    target = f"127.0.0.1:{GRPC_PORT}"
    t0, status = time.monotonic(), ""
    while time.monotonic() - t0 < 300 and status != "SERVING":
        status = health(target, 5.0)[0]
        time.sleep(2)
    assert status == "SERVING", f"gateway {status} after 300 s (logs: {play.parent})"
    print(f"gateway SERVING {time.monotonic() - t0:.0f} s after kube play")
    for i in range(2):
        ts = f"torchserve-pod-{i}-torchserve"
        # the base's readiness endpoint, served by the entry (a kubelet would GET it): 200
        # once this replica has a READY worker (the gateway is SERVING once any one has)
        get = ["podman", "exec", ts, "python", "-c", "import urllib.request as u; "
               "print(u.urlopen('http://127.0.0.1:8083/readyz', timeout=5).status)"]  # fmt: skip
        deadline = time.monotonic() + 180
        while (ready := _run(get)).stdout.strip() != "200" and time.monotonic() < deadline:
            time.sleep(2)
        assert ready.stdout.strip() == "200", (ready.stdout, ready.stderr[-500:])
        # the overlay's liveness command, run by hand (no systemd here for podman's timers)
        for _ in range(3):  # a Python start each: slow on a busy machine, so a few tries
            probe = _run(["podman", "healthcheck", "run", ts], timeout=60)
            if probe.returncode == 0:
                break
        assert probe.returncode == 0, (probe.stdout, probe.stderr)
        # the restricted context as podman applied it: no capabilities
        caps = _run(["podman", "exec", ts, "grep", "CapEff", "/proc/self/status"]).stdout
        assert caps.split()[-1] == "0000000000000000", caps
    assert _run(["podman", "exec", "gateway-pod-0-gateway", "touch", "/app/x"]).returncode != 0
    seen = _run(["podman", "exec", "gateway-pod-0-gateway", "cat", "/etc/recsys/gateway_token"])
    assert seen.stdout.strip() == TOKEN, seen  # the token itself, not its base64
    export, _, _ = exported
    s = np.load(export / "sample.npz")
    dense, sparse = s["dense"], to_rows(s["values"], s["lengths"])
    answered: set[str] = set()
    with grpc.insecure_channel(target) as ch:
        stub = ranker_pb2_grpc.RankerStub(ch)
        with pytest.raises(grpc.RpcError) as refused:  # the token is required
            stub.Score(build_request(dense[:5], sparse[:5]), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        deadline = time.monotonic() + 120
        while len(answered) < 2 and time.monotonic() < deadline:
            reply, call = stub.Score.with_call(
                build_request(dense[:50], sparse[:50]), metadata=call_metadata(TOKEN), timeout=30
            )
            np.testing.assert_allclose(np.asarray(reply.scores), s["probs_int8"][:50], atol=1e-5)
            answered.add(dict(call.trailing_metadata())["x-recsys-backend"])
    assert len(answered) == 2, f"replicas that answered: {answered}"  # both pods, by their IPs
    # KServe v2 REST on the other published port, with the same token
    with urllib.request.urlopen(f"http://127.0.0.1:{HTTP_PORT}/v2/health/ready", timeout=30) as r:
        assert r.status == 200
    meta = urllib.request.Request(
        f"http://127.0.0.1:{HTTP_PORT}/v2", headers={"Authorization": f"Bearer {TOKEN}"}
    )
    with urllib.request.urlopen(meta, timeout=30) as r:
        assert json.load(r)["name"]


def test_kube_down_leaves_nothing(kube: tuple[Path, list[str], dict[str, set[str]]]) -> None:
    """``kube down`` removes every pod and container it played, and the play made nothing
    else (no volume, network or secret): removing the volumes the test made leaves podman as
    it was before."""
    play, volumes, before = kube
    down = _run(["podman", "kube", "down", str(play)], timeout=300)
    assert down.returncode == 0, down.stderr
    after = state()
    assert not {p for p in after["pods"] if p.startswith(PODS)}, after["pods"]
    assert not {c for c in after["containers"] if c.startswith(PODS)}, after["containers"]
    assert after["volumes"] - before["volumes"] == set(volumes)  # the test's own, nothing more
    assert after["networks"] == before["networks"]
    assert after["secrets"] == before["secrets"]
    assert _run(["podman", "volume", "rm", *volumes]).returncode == 0
    assert state()["volumes"] == before["volumes"]
