"""deploy/k8s/ played for real with ``podman kube play``: the TorchServe Deployment (2 replicas)
and the gateway Deployment from the manifests as written, with the model and key volumes, the
ConfigMap and the token Secret; a client on the host scores through the gateway and both
replicas answer. What podman cannot play is replaced, and only that: Services (podman creates
none, so the gateway is pointed at the replica pods' own names, which its ``dns:///`` entries
resolve the same way), the pod IP from the downward API (podman 4.3 has none: the replica
takes what its hostname resolves to, the same address), and the gateway's ports are published
with hostPort."""

from __future__ import annotations

import base64
import copy
import json
import os
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import yaml

from recsys_stack.net import free_ports
from serving.gateway.auth import call_metadata
from serving.stubs import ranker_pb2_grpc
from serving.tools.client import build_request, health
from serving.worker.codec import to_rows
from tests.containers.conftest import ROOT, _run

pytestmark = pytest.mark.slow
MANIFESTS = ROOT / "deploy" / "k8s"
TOKEN = "kube-play-test-token-" + os.urandom(8).hex()
IMAGES = ("recsys-stack/torchserve", "recsys-stack/gateway", "recsys-python:3.11")


def require_podman() -> None:
    """Fails (never skips) naming the command that fixes it."""
    if shutil.which("podman") is None:
        pytest.fail("no podman: run `make container-deps images`")
    absent = [i for i in IMAGES if _run(["podman", "image", "exists", i]).returncode]
    if absent:
        pytest.fail(f"images not built: {', '.join(absent)}: run `make container-deps images`")


def played(suffix: str, grpc_port: int, http_port: int, replicas: int) -> list[dict[str, Any]]:
    """The manifests, renamed with ``suffix`` (pods and volumes are global to podman), the
    Services dropped (podman creates none), the gateway pointed at the replica pods' names and
    published on the host, and the token Secret the docs tell a user to create."""
    docs = [d for f in sorted(MANIFESTS.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text())]
    out = []
    for d in copy.deepcopy(docs):
        kind, name = d["kind"], d["metadata"]["name"]
        if kind == "Service":
            continue
        d["metadata"]["name"] = f"{name}-{suffix}"
        if kind == "ConfigMap":
            pods = [f"dns:///torchserve-{suffix}-pod-{i}:7070" for i in range(replicas)]
            d["data"]["RECSYS_TS_GRPC"] = ",".join(pods)
        if kind == "Deployment":
            spec = d["spec"]["template"]["spec"]
            for v in spec["volumes"]:
                if "persistentVolumeClaim" in v:
                    v["persistentVolumeClaim"]["claimName"] += f"-{suffix}"
                if "secret" in v:
                    v["secret"]["secretName"] += f"-{suffix}"
            for c in spec["containers"]:
                # podman 4.3 has no status.podIP: the entry falls back to its hostname's address
                c["env"] = [e for e in c.get("env", []) if e["name"] != "RECSYS_TS_ADVERTISE_HOST"]
                for ref in c.get("envFrom", []):
                    ref["configMapRef"]["name"] += f"-{suffix}"
                # podman 4.3 publishes every containerPort on the host (a cluster does not):
                # only the gateway's, on free ports of loopback
                host = {"grpc": grpc_port, "http": http_port} if name == "gateway" else {}
                c["ports"] = [
                    {**p, "hostPort": host[p["name"]], "hostIP": "127.0.0.1"}
                    for p in c["ports"]
                    if p["name"] in host
                ]
        out.append(d)
    secret = base64.b64encode(f"{TOKEN}\n".encode()).decode()
    out.append({"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": f"recsys-gateway-token-{suffix}"},
                "data": {"gateway_token": secret}})  # fmt: skip
    return out


def test_the_manifests_say_what_a_cluster_needs() -> None:
    """As written (not as played): a headless Service is the gateway's list of replicas, each
    replica names its key by its pod IP, the gateway reads keys and model read-only."""
    docs = {
        (d["kind"], d["metadata"]["name"]): d
        for f in MANIFESTS.glob("*.yaml")
        for d in yaml.safe_load_all(f.read_text())
    }
    assert docs[("Service", "torchserve")]["spec"]["clusterIP"] == "None"
    cfg = docs[("ConfigMap", "recsys-serving")]["data"]
    assert cfg["RECSYS_TS_GRPC"] == "dns:///torchserve:7070"
    assert cfg["RECSYS_TS_KEY_FILE"] == cfg["RECSYS_TS_INFERENCE_KEY_FILE"] == "/keys/{host}.json"
    ts = docs[("Deployment", "torchserve")]["spec"]["template"]["spec"]["containers"][0]
    assert ts["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    gw = docs[("Deployment", "gateway")]["spec"]["template"]["spec"]["containers"][0]
    assert gw["readinessProbe"]["grpc"]["port"] == 50051
    assert all(m.get("readOnly") for m in gw["volumeMounts"]), gw["volumeMounts"]


@pytest.fixture(scope="module")
def kube(exported: tuple[Path, Path, str], tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[int, int, Path, list[dict[str, Any]]]]:  # fmt: skip
    """The serving manifests played on a podman network with DNS; ``kube down`` after."""
    require_podman()
    export, store, _ = exported
    suffix = f"t{os.getpid()}"
    grpc_port, http_port = free_ports(2)
    docs = played(suffix, grpc_port, http_port, replicas=2)
    d = tmp_path_factory.mktemp("kube")
    first = ("PersistentVolumeClaim", "Secret")  # podman makes the volumes, the test fills them
    claims = d / "volumes.yaml"
    claims.write_text(yaml.safe_dump_all([x for x in docs if x["kind"] in first]))
    play = d / "serving.yaml"
    play.write_text(yaml.safe_dump_all([x for x in docs if x["kind"] not in first]))
    net, models, keys = f"recsys-{suffix}", f"recsys-models-{suffix}", f"recsys-keys-{suffix}"
    base = "localhost/recsys-python:3.11"
    try:
        assert _run(["podman", "network", "create", net]).returncode == 0
        made = _run(["podman", "kube", "play", str(claims)])
        assert made.returncode == 0, made.stderr
        fill = _run(["podman", "run", "--rm", "-v", f"{models}:/models", "-v", f"{keys}:/keys",
                     "-v", f"{store}:/src/store:ro", "-v", f"{export}:/src/export:ro", base,
                     "sh", "-c", "mkdir -p /models/model_store /models/export"
                     " && cp /src/store/*.mar /models/model_store/ && cp -r /src/export/. /models/export/"
                     " && chmod -R a+rX /models && chown 1000:1000 /keys"])  # fmt: skip
        assert fill.returncode == 0, fill.stderr
        t0 = time.monotonic()
        up = _run(["podman", "kube", "play", "--network", net, str(play)], timeout=600)
        (d / "play.log").write_text(up.stdout + up.stderr)
        assert up.returncode == 0, up.stderr[-3000:]
        print(f"kube play: {time.monotonic() - t0:.0f} s")
        yield grpc_port, http_port, d, docs
    finally:
        down = _run(["podman", "kube", "down", str(play)], timeout=300)
        (d / "down.log").write_text(down.stdout + down.stderr)
        _run(["podman", "kube", "down", str(claims)], timeout=120)
        _run(["podman", "secret", "rm", f"recsys-gateway-token-{suffix}"])
        for v in (models, keys, f"recsys-gateway-token-{suffix}"):
            _run(["podman", "volume", "rm", "-f", v])
        _run(["podman", "network", "rm", "-f", net])


def test_podman_plays_the_serving_manifests_and_a_client_scores(
    kube: tuple[int, int, Path, list[dict[str, Any]]], exported: tuple[Path, Path, str]
) -> None:
    grpc_port, http_port, d, docs = kube
    gw = next(x["metadata"]["name"] for x in docs if x["metadata"]["name"].startswith("gateway-"))
    target = f"127.0.0.1:{grpc_port}"
    t0, status = time.monotonic(), ""
    while time.monotonic() - t0 < 300 and status != "SERVING":
        status = health(target, 5.0)[0]
        time.sleep(2)
    assert status == "SERVING", f"gateway {status} after 300 s (logs: podman logs; {d})"
    print(f"gateway SERVING {time.monotonic() - t0:.0f} s after kube play")
    # the replicas' probe command, run by hand (no systemd here to run podman's timers for it)
    ts = next(
        x["metadata"]["name"] for x in docs if x["metadata"]["name"].startswith("torchserve-")
    )
    for i in range(2):
        probe = _run(["podman", "healthcheck", "run", f"{ts}-pod-{i}-torchserve"], timeout=60)
        assert probe.returncode == 0, (probe.stdout, probe.stderr)
    # the token as the gateway's pod sees it (podman 4.3 writes a Secret's data still base64)
    seen = _run(["podman", "exec", f"{gw}-pod-0-gateway", "cat", "/etc/recsys/gateway_token"])
    token = seen.stdout.strip()
    assert token in (TOKEN, base64.b64encode(f"{TOKEN}\n".encode()).decode()), seen
    export, _, _ = exported
    s = np.load(export / "sample.npz")
    dense, sparse = s["dense"], to_rows(s["values"], s["lengths"])
    answered: set[str] = set()
    with grpc.insecure_channel(target) as ch:
        stub = ranker_pb2_grpc.RankerStub(ch)
        with pytest.raises(grpc.RpcError) as refused:  # the Secret's token is required
            stub.Score(build_request(dense[:5], sparse[:5]), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        deadline = time.monotonic() + 120
        while len(answered) < 2 and time.monotonic() < deadline:
            reply, call = stub.Score.with_call(
                build_request(dense[:50], sparse[:50]), metadata=call_metadata(token), timeout=30
            )
            np.testing.assert_allclose(np.asarray(reply.scores), s["probs_int8"][:50], atol=1e-5)
            answered.add(dict(call.trailing_metadata())["x-recsys-backend"])
    assert len(answered) == 2, f"replicas that answered: {answered}"  # both pods, by their IPs
    # KServe v2 REST on the other published port, with the same token
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=30) as r:
        assert r.status == 200
    meta = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v2", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(meta, timeout=30) as r:
        assert json.load(r)["name"]


def test_kube_down_leaves_no_pod(kube: tuple[int, int, Path, list[dict[str, Any]]]) -> None:
    _, _, d, docs = kube
    play = d / "serving.yaml"
    down = _run(["podman", "kube", "down", str(play)], timeout=300)
    assert down.returncode == 0, down.stderr
    names = [x["metadata"]["name"] for x in docs if x["kind"] == "Deployment"]
    pods = _run(["podman", "pod", "ps", "--format", "{{.Name}}"]).stdout.split()
    assert not [p for p in pods if any(p.startswith(n) for n in names)], pods
    ctrs = _run(["podman", "ps", "-a", "--format", "{{.Names}}"]).stdout.split()
    assert not [c for c in ctrs if any(c.startswith(n) for n in names)], ctrs
