"""serving/tools/kustomize.py: the subset of kustomize deploy/k8s uses, on small folders."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from serving.tools.kustomize import KustomizeError, render

DEPLOY = {
    "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
    "spec": {"replicas": 2, "template": {"spec": {"containers": [{
        "name": "app", "image": "org/app:1.0",
        "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
        "ports": [{"containerPort": 80}, {"containerPort": 81}],
        "livenessProbe": {"httpGet": {"path": "/", "port": 80}},
    }]}}},
}  # fmt: skip
SERVICE = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}, "spec": {}}


def folder(tmp_path: Path, name: str, spec: dict, files: dict[str, object] | None = None) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    for f, body in (files or {}).items():
        docs = body if isinstance(body, list) and f.endswith(".multi.yaml") else [body]
        (d / f).write_text(yaml.safe_dump_all(docs))
    return d


def test_overlay_patches_images_and_deletes(tmp_path: Path) -> None:
    base = folder(tmp_path, "base", {"resources": ["all.multi.yaml"]},
                  {"all.multi.yaml": [DEPLOY, SERVICE]})  # fmt: skip
    smp = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "web"},
           "spec": {"template": {"spec": {"containers": [{
               "name": "app", "env": [{"name": "A", "$patch": "delete"}, {"name": "C", "value": "3"}],
               "livenessProbe": {"httpGet": None, "exec": {"command": ["true"]}}}]}}}}  # fmt: skip
    gone = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"}, "$patch": "delete"}
    overlay = folder(tmp_path, "overlay", {
        "resources": ["../base"],
        "patches": [
            {"path": "smp.multi.yaml"},
            {"target": {"kind": "Deployment", "name": "web"}, "patch":
             "- {op: replace, path: /spec/replicas, value: 1}\n"
             "- {op: remove, path: /spec/template/spec/containers/0/ports/1}\n"},
        ],
        "images": [{"name": "org/app", "newName": "reg.example/app", "newTag": "2.0"}],
    }, {"smp.multi.yaml": [smp, gone]})  # fmt: skip
    (out,) = render(overlay)
    c = out["spec"]["template"]["spec"]["containers"][0]
    assert out["spec"]["replicas"] == 1
    assert c["image"] == "reg.example/app:2.0"
    assert c["env"] == [{"name": "B", "value": "2"}, {"name": "C", "value": "3"}]
    assert c["ports"] == [{"containerPort": 80}]
    assert c["livenessProbe"] == {"exec": {"command": ["true"]}}
    assert render(base)[0] == DEPLOY  # the base itself is unchanged


@pytest.mark.parametrize(
    ("spec", "says"),
    [({"resources": ["x.yaml"], "namePrefix": "a-"}, "namePrefix not implemented"),
     ({"resources": ["missing.yaml"]}, "not a local file"),
     ({"resources": ["x.yaml"], "patches": [{"target": {"kind": "Deployment"},
       "patch": "- {op: replace, path: /spec/nope/x, value: 1}"}]}, "no such place"),
     ({"resources": ["x.yaml"], "patches": [{"patch": yaml.safe_dump(
       {"kind": "Service", "metadata": {"name": "other"}})}]}, "no Service other to patch")],
)  # fmt: skip
def test_what_it_cannot_render_is_an_error_naming_it(tmp_path: Path, spec: dict, says: str) -> None:
    d = folder(tmp_path, "k", spec, {"x.yaml": DEPLOY})
    with pytest.raises(KustomizeError, match=says):
        render(d)
