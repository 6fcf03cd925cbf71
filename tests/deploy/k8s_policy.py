"""Static policy checks of Kubernetes manifests: the Pod Security "restricted" profile and what a
production Deployment here needs. Each check is a function of the rendered documents that
returns its findings (``"Deployment/gateway container gateway: ..."``); none = it passes.

``python -m tests.deploy.k8s_policy FILE...`` prints every finding of every check on those files
(how the checks were seen to fail on the manifests before deploy/k8s/base existed:
``git show <commit>:deploy/k8s/gateway.yaml > /tmp/g.yaml``). checkov would check much of the
same; these are the ones this project promises, each small enough to read.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

Doc = dict[str, Any]
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")


def pods(docs: list[Doc]) -> Iterator[tuple[str, Doc, Doc]]:
    """``(where, workload, pod spec)`` of every workload."""
    for d in docs:
        if d.get("kind") in WORKLOADS:
            yield f"{d['kind']}/{d['metadata']['name']}", d, d["spec"]["template"]["spec"]


def containers(docs: list[Doc]) -> Iterator[tuple[str, Doc, Doc]]:
    """``(where, pod spec, container)`` of every container and init container."""
    for where, _, spec in pods(docs):
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            yield f"{where} container {c['name']}", spec, c


def run_as_non_root(docs: list[Doc]) -> list[str]:
    return [
        f"{w}: runAsNonRoot not true (pod or container securityContext)"
        for w, spec, c in containers(docs)
        if not c.get("securityContext", {}).get(
            "runAsNonRoot", spec.get("securityContext", {}).get("runAsNonRoot")
        )
    ]


def no_privilege_escalation(docs: list[Doc]) -> list[str]:
    return [
        f"{w}: allowPrivilegeEscalation is not false"
        for w, _, c in containers(docs)
        if c.get("securityContext", {}).get("allowPrivilegeEscalation") is not False
    ]


def drop_all_capabilities(docs: list[Doc]) -> list[str]:
    return [
        f"{w}: capabilities.drop does not list ALL"
        for w, _, c in containers(docs)
        if "ALL" not in c.get("securityContext", {}).get("capabilities", {}).get("drop", [])
    ]


def seccomp(docs: list[Doc]) -> list[str]:
    out = []
    for w, spec, c in containers(docs):
        profile = c.get("securityContext", {}).get("seccompProfile") or spec.get(
            "securityContext", {}
        ).get("seccompProfile", {})
        if profile.get("type") not in ("RuntimeDefault", "Localhost"):
            out.append(f"{w}: seccompProfile is not RuntimeDefault (or Localhost)")
    return out


def read_only_root(docs: list[Doc]) -> list[str]:
    return [
        f"{w}: readOnlyRootFilesystem is not true"
        for w, _, c in containers(docs)
        if c.get("securityContext", {}).get("readOnlyRootFilesystem") is not True
    ]


def resources(docs: list[Doc]) -> list[str]:
    out = []
    for w, _, c in containers(docs):
        r = c.get("resources", {})
        for part in ("requests", "limits"):
            missing = [k for k in ("cpu", "memory") if k not in r.get(part, {})]
            if missing:
                out.append(f"{w}: no {part} for {', '.join(missing)}")
    return out


def probes(docs: list[Doc]) -> list[str]:
    """Startup, readiness and liveness on every long-running container; readiness and liveness
    not the same check; no probe that starts an interpreter (seconds of CPU each time)."""
    out = []
    for w, _, c in containers(docs):
        for p in ("startupProbe", "readinessProbe", "livenessProbe"):
            if p not in c:
                out.append(f"{w}: no {p}")
        ready, live = c.get("readinessProbe"), c.get("livenessProbe")
        if ready and live and _check(ready) == _check(live):
            out.append(f"{w}: readiness and liveness are the same check")
        for p in ("startupProbe", "readinessProbe", "livenessProbe"):
            cmd = c.get(p, {}).get("exec", {}).get("command", [])
            if cmd and Path(cmd[0]).name.startswith("python"):
                out.append(f"{w}: {p} starts a Python interpreter at every probe")
    return out


def _check(probe: Doc) -> Any:
    return {k: v for k, v in probe.items() if k in ("exec", "httpGet", "grpc", "tcpSocket")}


def graceful_stop(docs: list[Doc]) -> list[str]:
    out = []
    for w, _, spec in pods(docs):
        if "terminationGracePeriodSeconds" not in spec:
            out.append(f"{w}: no terminationGracePeriodSeconds")
        for c in spec["containers"]:
            if "preStop" not in c.get("lifecycle", {}):
                out.append(f"{w} container {c['name']}: no preStop hook")
    return out


def spread_and_rollout(docs: list[Doc]) -> list[str]:
    """Deployments: spread over nodes; a rolling update that never lowers capacity; the
    gateway (the only entry) at 2 replicas or more."""
    out = []
    for w, d, spec in pods(docs):
        if d["kind"] != "Deployment":
            continue
        if not spec.get("topologySpreadConstraints"):
            out.append(f"{w}: no topologySpreadConstraints")
        rolling = d["spec"].get("strategy", {}).get("rollingUpdate", {})
        if rolling.get("maxUnavailable") != 0:
            out.append(f"{w}: rollingUpdate.maxUnavailable is not 0")
        if d["metadata"]["name"] == "gateway" and d["spec"].get("replicas", 1) < 2:
            out.append(f"{w}: fewer than 2 replicas")
    return out


def _selects(d: Doc, selector: Doc) -> bool:
    labels = d["spec"]["template"]["metadata"].get("labels", {})
    wanted = selector.get("matchLabels", {})
    return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())


def disruption_and_scaling(docs: list[Doc]) -> list[str]:
    """Every Deployment: a PodDisruptionBudget keeping one pod, an HPA on CPU."""
    out = []
    pdbs = [d for d in docs if d.get("kind") == "PodDisruptionBudget"]
    hpas = [d for d in docs if d.get("kind") == "HorizontalPodAutoscaler"]
    for w, d, _ in pods(docs):
        if d["kind"] != "Deployment":
            continue
        if not any(_selects(d, p["spec"]["selector"]) and p["spec"].get("minAvailable") == 1
                   for p in pdbs):  # fmt: skip
            out.append(f"{w}: no PodDisruptionBudget with minAvailable 1")
        name = d["metadata"]["name"]
        cpu = [h for h in hpas if h["spec"]["scaleTargetRef"]["name"] == name
               and any(m.get("resource", {}).get("name") == "cpu" for m in h["spec"]["metrics"])]  # fmt: skip
        if not cpu:
            out.append(f"{w}: no HorizontalPodAutoscaler on CPU")
    return out


def torchserve_isolated(docs: list[Doc]) -> list[str]:
    """TorchServe's pods: a NetworkPolicy admits ingress to its gRPC port from gateway pods only."""
    ts = next((d for d in docs if d.get("kind") == "Deployment"
               and d["metadata"]["name"] == "torchserve"), None)  # fmt: skip
    if ts is None:
        return []
    for p in (d for d in docs if d.get("kind") == "NetworkPolicy"):
        if not _selects(ts, p["spec"]["podSelector"]):
            continue
        grpc = [r for r in p["spec"].get("ingress", [])
                if any(x.get("port") == 7070 for x in r.get("ports", []))]  # fmt: skip
        sources = [f for r in grpc for f in r.get("from", [])]
        if sources and all(
            f.get("podSelector", {}).get("matchLabels") == {"app": "gateway"} for f in sources
        ):
            return []
    return ["Deployment/torchserve: no NetworkPolicy admitting only gateway pods to port 7070"]


POD_SECURITY: list[Callable[[list[Doc]], list[str]]] = [
    run_as_non_root, no_privilege_escalation, drop_all_capabilities, seccomp, read_only_root,
    resources,
]  # fmt: skip
PRODUCTION: list[Callable[[list[Doc]], list[str]]] = [
    *POD_SECURITY, probes, graceful_stop, spread_and_rollout, disruption_and_scaling,
    torchserve_isolated,
]  # fmt: skip


def findings(
    docs: list[Doc], checks: list[Callable[[list[Doc]], list[str]]]
) -> dict[str, list[str]]:
    """``{check name: its findings}`` for every check that found something."""
    return {c.__name__: f for c in checks if (f := c(docs))}


if __name__ == "__main__":
    found = [d for f in sys.argv[1:] for d in yaml.safe_load_all(Path(f).read_text()) if d]
    for check in PRODUCTION:
        problems = check(found)
        print(f"{check.__name__}: {'FAIL' if problems else 'ok'}")
        for p in problems:
            print(f"  {p}")
