"""The shape of the code base: module sizes, import graph, declared dependencies, repeats.

Pure reads of the source tree (no process started): what CONVENTIONS.md asks for, checked.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("recsys_stack", "recsys_model", "training", "serving", "loadtest", "streaming")
# The two stages share only the bottom layer: neither imports the other.
BOTTOM = ("recsys_stack", "recsys_model")
STAGES = ("training", "serving")
MAX_TOP_LEVEL = 10  # training/'s own .py files (__init__.py included; subpackages apart)
MAX_LINES = 400
# Imported, deliberately not declared in pyproject.toml (its comment says why): the fbgemm build
# depends on the device, torchrec is installed with --no-deps.
INSTALLED_BY_MAKE_SETUP = {"fbgemm_gpu", "torchrec"}
# Installed in an environment of their own, not the one pyproject.toml describes: PyFlink
# (`make flink-setup`: .venv-flink from requirements/flink.lock.txt; its protobuf and grpcio pins
# disagree with the serving lock), imported by streaming/ alone.
OWN_ENVIRONMENT = {"pyflink": "streaming"}
# What streaming/ (run under .venv-flink) may import of the project: the standard-library parts
# of the bottom layer, nothing of the stages.
STREAMING_MAY_IMPORT = ("streaming", "recsys_stack.online", "recsys_stack.config",
                        "recsys_stack.typed", "recsys_model.atomic")  # fmt: skip
# Imported only inside a TorchServe worker, from the archive's own folder, where the export packs
# serving/worker/{codec,scoring,deltas}.py and recsys_model/{features,mapped,portable_model,delta,
# atomic}.py flat.
ARCHIVE_LOCAL = {"atomic", "codec", "delta", "deltas", "features", "mapped", "portable_model",
                 "scoring", "torch_codec"}  # fmt: skip


def modules() -> dict[str, Path]:
    """``{dotted module name: path}`` of the project's packages, generated stubs excluded."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "_gen" in rel.parts:
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(path: Path, name: str, typing_only: bool = True) -> list[str]:
    """Absolute names imported anywhere in ``path``; ``typing_only=False`` leaves out the
    ``if TYPE_CHECKING:`` blocks."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if (
            not typing_only
            and isinstance(node, ast.If)
            and "TYPE_CHECKING" in ast.unparse(node.test)
        ):
            skip |= {id(n) for n in ast.walk(node)}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            found.append(mod)
            found += [f"{mod}.{a.name}" for a in node.names]  # `from pkg import module`
    return found


def import_graph(typing_only: bool = True) -> dict[str, set[str]]:
    """Module -> the project modules it imports (those of ``if TYPE_CHECKING:`` blocks too,
    unless ``typing_only`` is False: a circle through type hints is still two modules that
    each need the other, issue 46 item 9's evaluator <-> step_loop)."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for imported in _imports(path, name, typing_only):
            # the imported module, or the closest project package containing it
            parts = imported.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            target = ".".join(parts)
            if target and target != name and not name.startswith(target + "."):
                deps.add(target)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """Every import circle: the strongly connected groups of two or more modules (Tarjan),
    each as a sorted tuple, so that one test run names all of them, not only the first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[tuple[str, ...]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(tuple(sorted(group)))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_cycle_finder_finds_cycles() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [("a", "b", "c")]
    two = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c", "a"}}
    assert cycles(two) == [("a", "b"), ("c", "d", "e")]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 40  # the walk found the project
    found = cycles(graph)
    assert not found, "import circles (break each): " + "; ".join(" <-> ".join(c) for c in found)


def test_the_stages_share_only_the_bottom_layer() -> None:
    # training and serving never import each other; what both need lives in recsys_stack
    # (config, logs, net) or recsys_model (the transforms, the portable scorer, the tables).
    arrows = sorted(
        f"{name} -> {dep}"
        for name, deps in import_graph().items()
        for dep in deps
        for top, other in (("training", "serving"), ("serving", "training"))
        if name.split(".")[0] == top and dep.split(".")[0] == other
    )
    assert not arrows, "imports across the stages (move what both use to the bottom layer): " + (
        "; ".join(arrows)
    )
    upward = sorted(
        f"{name} -> {dep}"
        for name, deps in import_graph().items()
        if name.split(".")[0] in BOTTOM
        for dep in deps
        if dep.split(".")[0] in STAGES
    )
    assert not upward, "the bottom layer imports a stage: " + "; ".join(upward)


def test_streaming_imports_only_what_its_environment_holds() -> None:
    # streaming/ runs under .venv-flink (PyFlink, no torch, no grpc of ours): of the project only
    # the standard-library modules of the bottom layer; and no stage imports it.
    graph = import_graph()
    bad = sorted(
        f"{name} -> {dep}"
        for name, deps in graph.items()
        for dep in deps
        if (name.startswith("streaming") and not dep.startswith(STREAMING_MAY_IMPORT))
        or (dep.startswith("streaming") and not name.startswith("streaming"))
    )
    assert not bad, "streaming/ imports beyond its environment, or is imported: " + "; ".join(bad)


def test_serving_torchserve_does_not_import_the_gateway() -> None:
    # TorchServe's side reads the plan file; the format lives below both (serving.plan).
    arrows = sorted(
        f"{name} -> {dep}"
        for name, deps in import_graph().items()
        if name.startswith("serving.torchserve")
        for dep in deps
        if dep.startswith("serving.gateway")
    )
    assert not arrows, "serving.torchserve imports the gateway: " + "; ".join(arrows)


def test_training_top_level_is_small() -> None:
    top = sorted(p.name for p in (ROOT / "training").glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, f"training/ has {len(top)} modules at its top: {top}"


def test_no_module_over_400_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in [*modules().values(), *(ROOT / "docker").glob("*.py")]
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these (> {MAX_LINES} lines): {long}"


def _declared() -> set[str]:
    """Distribution names (normalized) that pyproject.toml lists, all extras included."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return {_norm(re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0]) for r in reqs}


def _norm(dist: str) -> str:
    return re.sub(r"[-_.]+", "-", dist).lower()


def test_every_third_party_import_is_declared() -> None:
    dists = importlib.metadata.packages_distributions()
    declared = _declared()
    own = {*PACKAGES, "tests"}
    missing = defaultdict(set)
    for name, path in [*modules().items(), *(("tests", p) for p in (ROOT / "tests").rglob("*.py"))]:
        for imported in _imports(path, name):
            top = imported.split(".")[0]
            if (
                not top
                or top in own
                or top in sys.stdlib_module_names
                or top in INSTALLED_BY_MAKE_SETUP
                or top in ARCHIVE_LOCAL
                or (top in OWN_ENVIRONMENT and name.startswith(OWN_ENVIRONMENT[top]))
            ):
                continue
            owners = {_norm(d) for d in dists.get(top, [])}
            if not owners & declared:
                missing[top].add(str(path.relative_to(ROOT)))
    assert not missing, f"imported but not declared in pyproject.toml: {dict(missing)}"


def _blocks(path: Path, size: int) -> list[tuple[tuple[str, ...], int]]:
    """Windows of ``size`` consecutive significant lines, with their first line number."""
    lines = []
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        text = raw.strip()
        if text and not text.startswith(("#", "import ", "from ")) and text not in (")", "]", "}"):
            lines.append((n, text))
    return [
        (tuple(t for _, t in lines[i : i + size]), lines[i][0])
        for i in range(len(lines) - size + 1)
    ]


@pytest.mark.parametrize("pkg", ["serving", "loadtest"])
def test_no_block_of_six_lines_repeated(pkg: str) -> None:
    seen: dict[tuple[str, ...], str] = {}
    repeats = []
    for name, path in modules().items():
        if not name.startswith(pkg):
            continue
        for block, line in _blocks(path, 6):
            where = f"{path.relative_to(ROOT)}:{line}"
            if block in seen:
                repeats.append(f"{seen[block]} and {where}")
            seen.setdefault(block, where)
    assert not repeats, "six or more lines repeated: " + "; ".join(repeats[:5])
