"""deploy/k8s/training/train-job.yaml: what ties its parts together, and its pods' script run.

No cluster here, and ``podman kube play`` plays Pods and Deployments, not Jobs or Services
(ENGINES.md), so two things are checked: the wiring a cluster would rely on (the headless
Service selects the Job's pods and is their subdomain, the rendezvous host is pod 0's name
under it, one number of nodes in the three places, the shared volume ReadWriteMany and mounted
where the run goes), and the container's own command, run as two processes on this machine
with the Job's environment (``JOB_COMPLETION_INDEX`` 0 and 1, as the Indexed Job sets it; only
the rendezvous host, the shared folder and the sizes replaced): the two "pods" rendezvous,
train the tiny preset together and checkpoint with world size 2.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from recsys_stack.net import free_ports
from tests.conftest import ROOT, VENV_BIN, _env

MANIFEST = ROOT / "deploy" / "k8s" / "training" / "train-job.yaml"
DOCS = {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}


def _container() -> dict[str, Any]:
    (container,) = DOCS["Job"]["spec"]["template"]["spec"]["containers"]
    return container


def _env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"]}


def test_the_service_job_and_volume_fit_together() -> None:
    service, job, claim = DOCS["Service"], DOCS["Job"], DOCS["PersistentVolumeClaim"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    env = _env_of(_container())
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(env["NNODES"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert service["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    assert pod["subdomain"] == service["metadata"]["name"]
    assert env["RDZV_HOST"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert {p["port"] for p in service["spec"]["ports"]} == {int(env["RDZV_PORT"])}
    assert {p["containerPort"] for p in _container()["ports"]} == {int(env["RDZV_PORT"])}
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    (shared,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert shared["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    mounts = {m["name"]: m["mountPath"] for m in _container()["volumeMounts"]}
    assert mounts[shared["name"]] == env["SHARED"]
    assert (ROOT / "training" / "configs" / f"{env['PRESET']}.toml").is_file()


@pytest.mark.slow
def test_the_pods_command_trains_on_two_pods(tmp_path: Path) -> None:
    container = _container()
    port = free_ports(1)[0]
    env = {
        **_env_of(container), "PRESET": "tiny", "NPROC": "1", "SHARED": str(tmp_path),
        "RDZV_HOST": "127.0.0.1", "RDZV_PORT": str(port), "RDZV_ID": f"test-{port}",
        "TRAIN_ARGS": "train.max_steps=20 train.collective_timeout=60",
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",  # the image's python
    }  # fmt: skip
    logs = [tmp_path / f"pod-{i}.log" for i in range(2)]
    pods = []
    for i, log in enumerate(logs):  # to files: a pipe nobody reads yet could fill and block
        with log.open("w") as out:
            pods.append(subprocess.Popen(
                container["command"], cwd=ROOT, env=_env({**env, "JOB_COMPLETION_INDEX": str(i)}),
                stdout=out, stderr=subprocess.STDOUT,
            ))  # fmt: skip
    try:
        codes = [pod.wait(timeout=300) for pod in pods]
    finally:
        for pod in pods:
            pod.kill()
    assert codes == [0, 0], "".join(log.read_text()[-3000:] for log in logs)
    ckpts = tmp_path / "runs" / "tiny" / "checkpoints"
    latest = (ckpts / "latest").read_text().strip()
    assert latest == "step_00000020"
    meta = json.loads((ckpts / latest / "meta.json").read_text())
    assert meta["world_size"] == 2 and sorted(r["node"] for r in meta["reads"]) == [0, 1]
    assert list((tmp_path / "cache").glob("criteo-*/meta.json"))  # the data on the volume
