"""A small kustomize: render a ``kustomization.yaml`` folder to plain YAML, without kustomize.

``python -m serving.tools.kustomize render deploy/k8s/overlays/podman > serving.yaml``

Kustomize is not installed everywhere these manifests are checked (no cluster tools here, no
network but PyPI's), so this renders the subset deploy/k8s uses, and refuses the rest: a key of
``kustomization.yaml`` it does not implement is an error naming it, never silently ignored.
``kubectl kustomize DIR`` (or ``kustomize build DIR``) gives the same documents for these
folders on a machine that has it.

The subset, with kustomize's meaning:

- ``resources``: files (every YAML document in them) and folders holding a
  ``kustomization.yaml`` (rendered first, recursively), in order.
- ``patches``: each ``{path: FILE}`` or ``{patch: TEXT}``, optionally with ``target: {kind,
  name}``. A patch that is a YAML list is a JSON 6902 patch (``op`` ``add``, ``remove``,
  ``replace``, ``test``; RFC 6901 paths with ``~0``/``~1`` and ``-`` to append) applied to the
  target. Otherwise it is a strategic merge patch matched by its own ``kind`` and
  ``metadata.name``: maps merge; a ``null`` value removes the key; lists of maps with a merge
  key (``name``; ``containerPort`` for container ports, ``port`` for Service ports,
  ``mountPath`` for volumeMounts) merge item by item, other lists are replaced;
  ``$patch: delete`` removes a list item or the whole resource, ``$patch: replace`` replaces a
  map instead of merging it.
- ``images``: ``{name, newName, newTag, digest}``: every container (and init container) whose
  image is ``name`` (with any tag) gets the new name and tag (or ``@digest``).

Not implemented (an error if used): generators, namePrefix/nameSuffix, labels, namespace,
replacements, components, remote resources, and name-reference rewriting.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "resources", "patches", "images"}
FILE_NAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
Doc = dict[str, Any]


class KustomizeError(ValueError):
    """A kustomization this renderer cannot render as kustomize would: says where and why."""


def kustomization_file(folder: Path) -> Path:
    for name in FILE_NAMES:
        if (folder / name).is_file():
            return folder / name
    raise KustomizeError(f"{folder}: no kustomization.yaml in it")


def load_yaml(path: Path) -> list[Any]:
    try:
        return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except (OSError, yaml.YAMLError) as e:
        raise KustomizeError(f"{path}: {e}") from None


def render(folder: Path) -> list[Doc]:
    """The documents ``kustomize build folder`` gives, for the subset above."""
    folder = Path(folder)
    spec = load_yaml(kustomization_file(folder))
    spec = spec[0] if spec else {}
    unknown = sorted(set(spec) - KNOWN_KEYS)
    if unknown:
        raise KustomizeError(
            f"{folder}: {', '.join(unknown)} not implemented by serving/tools/kustomize.py "
            f"(it knows {', '.join(sorted(KNOWN_KEYS - {'apiVersion', 'kind'}))})"
        )
    docs: list[Doc] = []
    for entry in spec.get("resources", []):
        path = folder / entry
        if "://" in entry or not path.exists():
            raise KustomizeError(f"{folder}: resource {entry} is not a local file or folder")
        docs += render(path) if path.is_dir() else load_yaml(path)
    for n, patch in enumerate(spec.get("patches", [])):
        docs = apply_patch(docs, patch, f"{folder}: patches[{n}]", folder)
    for image in spec.get("images", []):
        set_image(docs, image)
    return docs


def apply_patch(docs: list[Doc], entry: Doc, where: str, folder: Path) -> list[Doc]:
    if "path" in entry:
        body = load_yaml(folder / entry["path"])
    elif "patch" in entry:
        body = [d for d in yaml.safe_load_all(entry["patch"]) if d is not None]
    else:
        raise KustomizeError(f"{where}: neither path nor patch")
    body = body[0] if len(body) == 1 and isinstance(body[0], list) else body  # a 6902 list
    target = entry.get("target")
    if body and all(isinstance(op, dict) and "op" in op for op in body):  # JSON 6902
        if not target:
            raise KustomizeError(f"{where}: a JSON 6902 patch needs a target")
        targets = [d for d in docs if matches(d, target)]
        if not targets:
            raise KustomizeError(f"{where}: no resource matches target {target}")
        for d in targets:
            for op in body:
                json6902(d, op, where)
        return docs
    for smp in body:
        kind, name = smp.get("kind"), smp.get("metadata", {}).get("name")
        hits = [i for i, d in enumerate(docs) if matches(d, {"kind": kind, "name": name})]
        if not hits:
            raise KustomizeError(f"{where}: no {kind} {name} to patch")
        if smp.get("$patch") == "delete":
            docs = [d for i, d in enumerate(docs) if i not in hits]
            continue
        for i in hits:
            docs[i] = merge(docs[i], smp)
    return docs


def matches(doc: Doc, target: Doc) -> bool:
    return all(
        doc.get(k) == target[k] if k == "kind" else doc.get("metadata", {}).get(k) == target[k]
        for k in ("kind", "name")
        if target.get(k) is not None
    )


def merge_key(field: str, items: list[Any]) -> str | None:
    """The strategic-merge key of list ``field`` (None: the list is replaced whole)."""
    if not items or not all(isinstance(i, dict) for i in items):
        return None
    if field == "volumeMounts":
        return "mountPath"
    if field == "ports":
        return "containerPort" if "containerPort" in items[0] else "port"
    return "name" if all("name" in i for i in items) else None


def merge(base: Any, patch: Any, field: str = "") -> Any:
    """Strategic merge of ``patch`` into ``base`` (a new value; neither is changed)."""
    if isinstance(patch, dict) and isinstance(base, dict):
        if patch.get("$patch") == "replace":
            return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(patch, list) and isinstance(base, list):
        key = merge_key(field, patch + base)
        if key is None:
            return copy.deepcopy(patch)
        items: list[Any] = copy.deepcopy(base)
        for item in patch:
            at = next((i for i, b in enumerate(items) if b.get(key) == item.get(key)), None)
            if item.get("$patch") == "delete":
                if at is not None:
                    items.pop(at)
            elif at is None:
                items.append(copy.deepcopy(item))
            else:
                items[at] = merge(items[at], item)
        return items
    return copy.deepcopy(patch)


def _pointer(path: str, where: str) -> list[str]:
    if not path.startswith("/"):
        raise KustomizeError(f"{where}: path {path!r} does not start with /")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def json6902(doc: Doc, op: Doc, where: str) -> None:
    """Apply one RFC 6902 operation to ``doc`` in place."""
    kind = op["op"]
    if kind not in ("add", "remove", "replace", "test"):
        raise KustomizeError(f"{where}: op {kind} not implemented")
    *parents, last = _pointer(op["path"], where)
    node: Any = doc
    try:
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            at = len(node) if last == "-" else int(last)
            if kind == "add":
                node.insert(at, copy.deepcopy(op["value"]))
            elif kind == "remove":
                node.pop(at)
            elif kind == "replace":
                node[at] = copy.deepcopy(op["value"])
            elif kind == "test" and node[at] != op["value"]:
                raise KustomizeError(f"{where}: test {op['path']} failed")
        elif kind in ("add", "replace"):
            if kind == "replace" and last not in node:
                raise KeyError(last)
            node[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del node[last]
        elif kind == "test" and node[last] != op["value"]:
            raise KustomizeError(f"{where}: test {op['path']} failed")
    except (KeyError, IndexError, TypeError) as e:
        raise KustomizeError(f"{where}: {kind} {op['path']}: no such place ({e})") from None
    except ValueError as e:  # a list index that is no number
        if isinstance(e, KustomizeError):
            raise
        raise KustomizeError(f"{where}: {op['op']} {op['path']}: no such place ({e})") from None


def set_image(docs: list[Doc], image: Doc) -> None:
    name = image["name"]
    for d in docs:
        spec = d.get("spec", {}).get("template", {}).get("spec", d.get("spec", {}))
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            current = c.get("image", "")
            bare = current.split("@")[0]
            bare = bare.rsplit(":", 1)[0] if ":" in bare.rsplit("/", 1)[-1] else bare
            if bare != name:
                continue
            tag = current[len(bare) :]
            new = image.get("newName", bare)
            if "digest" in image:
                tag = "@" + image["digest"]
            elif "newTag" in image:
                tag = ":" + str(image["newTag"])
            c["image"] = new + tag


def claims(docs: list[Doc]) -> list[str]:
    """The claim names the rendered workloads mount (with ``podman kube play``: the volumes
    to create and fill before playing), in order, once each."""
    names = [
        v["persistentVolumeClaim"]["claimName"]
        for d in docs
        for v in d.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", [])
        if "persistentVolumeClaim" in v
    ]
    return list(dict.fromkeys(names))


def dump(docs: list[Doc]) -> str:
    return yaml.safe_dump_all(docs, sort_keys=False, default_flow_style=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m serving.tools.kustomize", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="print the folder's documents as one YAML stream")
    r.add_argument("folder", type=Path)
    r.add_argument("-o", "--output", type=Path, help="write here instead of stdout")
    c = sub.add_parser("claims", help="print the claim names the workloads mount, one a line")
    c.add_argument("folder", type=Path)
    args = parser.parse_args(argv)
    try:
        docs = render(args.folder)
    except KustomizeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.command == "claims":
        print("\n".join(claims(docs)))
    elif args.output:
        args.output.write_text(dump(docs))
    else:
        sys.stdout.write(dump(docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
