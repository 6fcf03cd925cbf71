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
PACKAGES = ("recsys_stack", "training", "serving", "loadtest")
MAX_LINES = 400
# Imported, deliberately not declared in pyproject.toml (its comment says why): the fbgemm build
# depends on the device, torchrec is installed with --no-deps.
INSTALLED_BY_MAKE_SETUP = {"fbgemm_gpu", "torchrec"}
# Imported only inside a TorchServe worker, from the archive's own folder (handler -> codec).
ARCHIVE_LOCAL = {"codec", "features", "mapped", "portable_model", "scoring", "torch_codec"}


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


def _imports(path: Path, name: str) -> list[str]:
    """Absolute names imported anywhere in ``path`` (``if TYPE_CHECKING:`` blocks excluded)."""
    tree = ast.parse(path.read_text())
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
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


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        deps = set()
        for imported in _imports(path, name):
            # the imported module, or the closest project package containing it
            parts = imported.split(".")
            while parts and ".".join(parts) not in mods:
                parts.pop()
            target = ".".join(parts)
            if target and target != name and not name.startswith(target + "."):
                deps.add(target)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 40  # the walk found the project
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


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
