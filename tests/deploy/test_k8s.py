"""deploy/k8s rendered (base and both overlays) and checked without a cluster: every document
against the Kubernetes API schema of named versions (``kubernetes-validate``, strict: unknown
fields are errors), the policy checks of tests/deploy/k8s_policy.py, and what ties the parts
together. tests/containers/test_kube.py plays the podman overlay for real."""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from serving.tools.kustomize import claims, render
from tests.deploy import k8s_policy as policy

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
FOLDERS = {"base": K8S / "base", "cluster": K8S / "overlays" / "cluster",
           "podman": K8S / "overlays" / "podman"}  # fmt: skip
# The oldest version the manifests promise (gRPC probes GA, autoscaling/v2, policy/v1) and a
# recent one; kubernetes-validate ships the OpenAPI schemas of each.
K8S_VERSIONS = ("1.27.0", "1.34.0")
Doc = dict[str, Any]


def kubernetes_validate() -> Any:
    """The package, or a failure naming the command that installs it (never a skip)."""
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail(
            "kubernetes-validate is not installed: `make setup` (it is in the dev extra), or "
            "`.venv/bin/pip install --no-deps --require-hashes -r requirements/lock.txt`"
        )
    return kubernetes_validate


def by_name(docs: list[Doc]) -> dict[tuple[str, str], Doc]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", sorted(FOLDERS))
def test_every_rendered_manifest_matches_the_kubernetes_schema(overlay: str, version: str) -> None:
    kv = kubernetes_validate()
    docs = render(FOLDERS[overlay])
    assert docs
    for d in docs:
        try:
            kv.validate(d, version, strict=True)
        except kv.ValidationError as e:
            where = "/".join(str(p) for p in e.path)
            pytest.fail(f"{overlay}: {d['kind']}/{d['metadata']['name']} at {where}: {e.message}")


def test_the_schema_check_rejects_a_wrong_field() -> None:
    kv = kubernetes_validate()
    d = copy.deepcopy(by_name(render(FOLDERS["base"]))[("Deployment", "gateway")])
    d["spec"]["template"]["spec"]["containers"][0]["resources"]["limit"] = {"cpu": "1"}
    with pytest.raises(kv.ValidationError):
        kv.validate(d, K8S_VERSIONS[0], strict=True)


@pytest.mark.parametrize("overlay", ["base", "cluster"])
def test_the_cluster_manifests_pass_every_policy_check(overlay: str) -> None:
    assert policy.findings(render(FOLDERS[overlay]), policy.PRODUCTION) == {}


def test_the_podman_overlay_keeps_the_pod_security() -> None:
    """What podman plays runs as a cluster would run it: non-root, no escalation, no
    capabilities, seccomp, limits; a read-only root for all but TorchServe, whose work
    directory cannot be an emptyDir under podman 4.3 (overlays/podman/no-emptydir.yaml)."""
    docs = render(FOLDERS["podman"])
    assert policy.findings(docs, policy.POD_SECURITY) == {
        "read_only_root": [
            "Deployment/torchserve container torchserve: readOnlyRootFilesystem is not true"
        ]
    }
    assert "emptyDir" not in yaml.safe_dump_all(docs)  # podman shares them between pods


def _container(docs: list[Doc], name: str) -> Doc:
    return by_name(docs)[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]


def _pod(docs: list[Doc], name: str) -> Doc:
    return by_name(docs)[("Deployment", name)]["spec"]["template"]["spec"]


def _drop(docs: list[Doc], kind: str) -> None:
    docs[:] = [d for d in docs if d["kind"] != kind]


# One way to break each check, applied to the rendered base: the check must then fail (the
# checks were also seen failing on the manifests before deploy/k8s/base: docs/deploy.md).
BREAK: dict[str, Callable[[list[Doc]], None]] = {
    "run_as_non_root": lambda d: [
        _pod(d, "gateway")["securityContext"].pop("runAsNonRoot"),
        _container(d, "gateway")["securityContext"].pop("runAsNonRoot"),
    ],
    "no_privilege_escalation": lambda d: _container(d, "torchserve")["securityContext"].pop(
        "allowPrivilegeEscalation"
    ),
    "drop_all_capabilities": lambda d: _container(d, "gateway")["securityContext"].update(
        capabilities={"drop": ["NET_RAW"]}
    ),
    "seccomp": lambda d: _pod(d, "torchserve")["securityContext"].pop("seccompProfile"),
    "read_only_root": lambda d: _container(d, "gateway")["securityContext"].update(
        readOnlyRootFilesystem=False
    ),
    "resources": lambda d: _container(d, "torchserve")["resources"].pop("limits"),
    "probes": lambda d: _container(d, "torchserve").update(
        readinessProbe={"exec": {"command": ["python", "docker/healthcheck.py", "torchserve"]}}
    ),
    "graceful_stop": lambda d: _container(d, "gateway").pop("lifecycle"),
    "spread_and_rollout": lambda d: by_name(d)[("Deployment", "gateway")]["spec"].update(
        replicas=1
    ),
    "disruption_and_scaling": lambda d: _drop(d, "PodDisruptionBudget"),
    "torchserve_isolated": lambda d: _drop(d, "NetworkPolicy"),
}


@pytest.mark.parametrize("check", policy.PRODUCTION, ids=lambda c: c.__name__)
def test_each_policy_check_fails_on_a_manifest_that_breaks_it(
    check: Callable[[list[Doc]], list[str]],
) -> None:
    docs = copy.deepcopy(render(FOLDERS["base"]))
    assert check(docs) == []
    BREAK[check.__name__](docs)
    assert check(docs), f"{check.__name__} passed a manifest that breaks it"


def test_the_base_says_what_a_cluster_needs() -> None:
    """A headless Service is the gateway's list of replicas, each replica names its key by its
    pod IP, the gateway reads keys and model read-only, TorchServe's workers follow its CPU
    limit, and every path a program writes is a volume (the root filesystem is read-only)."""
    docs = render(FOLDERS["base"])
    found = by_name(docs)
    assert found[("Service", "torchserve")]["spec"]["clusterIP"] == "None"
    cfg = found[("ConfigMap", "recsys-serving")]["data"]
    assert cfg["RECSYS_TS_GRPC"] == "dns:///torchserve:7070"
    assert cfg["RECSYS_TS_KEY_FILE"] == cfg["RECSYS_TS_INFERENCE_KEY_FILE"] == "/keys/{host}.json"
    assert cfg["RECSYS_TS_WORKERS"] == "0"  # = the cgroup quota: limits.cpu
    ts = _container(docs, "torchserve")
    assert ts["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert ts["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert {p["containerPort"] for p in ts["ports"] if p["name"] == "probes"} == {
        int(cfg["RECSYS_TS_PROBE_PORT"])
    }
    mounts = {m["mountPath"] for m in ts["volumeMounts"]}
    assert {"/tmp", str(Path(cfg["RECSYS_TS_WORKDIR"]).parent)} <= mounts
    gw = _container(docs, "gateway")
    assert gw["readinessProbe"]["grpc"]["port"] == 50051
    assert all(m.get("readOnly") for m in gw["volumeMounts"] if m["mountPath"] != "/tmp")
    assert not any("storageClassName" in d.get("spec", {}) for d in docs)  # the cluster's


def test_the_cluster_overlay_names_registry_images() -> None:
    docs = render(FOLDERS["cluster"])
    images = [c["image"] for d in docs if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]]  # fmt: skip
    assert images and all("/recsys-" in i and not i.startswith("recsys-stack/") for i in images)
    assert all(not i.endswith(":latest") for i in images), images
    storage = yaml.safe_load_all((FOLDERS["cluster"] / "storage-class.yaml").read_text())
    assert {d["metadata"]["name"] for d in storage} == set(claims(docs))  # every claim


def test_the_podman_overlay_has_only_what_podman_plays() -> None:
    """No Services, policies or claims; no downward API; the gateway names each replica pod
    podman makes (``<deployment>-pod-<i>``); host ports only for the gateway, on loopback."""
    docs = render(FOLDERS["podman"])
    assert {d["kind"] for d in docs} == {"ConfigMap", "Deployment"}
    assert "fieldRef" not in yaml.safe_dump_all(docs)
    found = by_name(docs)
    replicas = found[("Deployment", "torchserve")]["spec"]["replicas"]
    grpc = found[("ConfigMap", "recsys-serving")]["data"]["RECSYS_TS_GRPC"]
    assert grpc.split(",") == [f"dns:///torchserve-pod-{i}:7070" for i in range(replicas)]
    assert "ports" not in _container(docs, "torchserve")
    gw_ports = _container(docs, "gateway")["ports"]
    assert all(p["hostIP"] == "127.0.0.1" for p in gw_ports)
    assert found[("Deployment", "gateway")]["spec"]["replicas"] == 1
    assert claims(docs) == ["recsys-models", "recsys-keys", "recsys-gateway-token"]
    for name in ("gateway", "torchserve"):  # podman runs none of these; liveness as a command
        c = _container(docs, name)
        assert "startupProbe" not in c and "readinessProbe" not in c
        assert set(c["livenessProbe"]) >= {"exec"} and "httpGet" not in c["livenessProbe"]
        # podman 4.3 joins the command and splits it on spaces again
        assert not [a for a in c["livenessProbe"]["exec"]["command"] if " " in a]


def test_the_render_command_prints_what_render_returns(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "serving.tools.kustomize", "render", str(FOLDERS["podman"])],
        capture_output=True, text=True, cwd=ROOT, check=True,
    )  # fmt: skip
    assert list(yaml.safe_load_all(out.stdout)) == render(FOLDERS["podman"])
