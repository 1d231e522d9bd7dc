"""The layout's promises: the ingress imports no torch, and neither the modules nor the
packages (each folder one node, its own modules together) import each other in a cycle,
counting imports under `if TYPE_CHECKING:` too."""

from __future__ import annotations

import ast
import subprocess
import sys

from tests.support.paths import REPO_ROOT

PACKAGES = ("serve_app", "workers")


def test_importing_the_ingress_pulls_in_no_torch():
    # ... nor the autoscaling policy, which Serve's controller imports.
    code = ("import sys, serve_app.ingress, serve_app.handle_api, workers.contract.grammar,"
            " workers.serving.engine_load_policy;"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _module_name(path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """Modules of ours imported anywhere in the file, `if TYPE_CHECKING:` blocks included:
    a type-only import is still a dependency of the design."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in modules}


def import_graph() -> dict[str, set[str]]:
    files = [p for pkg in PACKAGES for p in (REPO_ROOT / pkg).rglob("*.py")]
    modules = {_module_name(p) for p in files}
    return {_module_name(p): _imports(ast.parse(p.read_text()), modules) - {_module_name(p)} for p in files}


def package_of(module: str) -> str:
    """The folder a module lives in (a package's __init__ is its folder's)."""
    path = REPO_ROOT / module.replace(".", "/")
    return module if path.is_dir() else module.rpartition(".")[0]


def package_graph(graph: dict[str, set[str]], folder=package_of) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, imported in graph.items():
        own = folder(module)
        packages.setdefault(own, set()).update(p for p in map(folder, imported) if p != own)
    return packages


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_module_import_cycles():
    assert find_cycle(import_graph()) is None


def test_no_package_import_cycles():
    assert find_cycle(package_graph(import_graph())) is None


def test_the_core_imports_only_the_contract():
    """workers/core is the neutral layer every worker package builds on."""
    packages = package_graph(import_graph())
    assert packages["workers.core"] <= {"workers.contract"}
    assert packages["workers.contract"] == set()


def test_type_only_imports_count():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a.b import C\n")
    assert _imports(tree, {"a.b"}) == {"a.b"}


def test_a_package_cycle_is_found_through_modules_of_different_folders():
    graph = {"p.x": {"q.y"}, "q.y": set(), "q.z": {"p.w"}, "p.w": set()}
    packages = {"p": {"q"}, "q": {"p"}}
    by_prefix = package_graph(graph, folder=lambda m: m.rpartition(".")[0])
    assert by_prefix == packages
    assert find_cycle(packages) == ["p", "q", "p"]


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_tools_live_outside_the_product_packages():
    names = {p.stem for pkg in PACKAGES for p in (REPO_ROOT / pkg).rglob("*.py")}
    assert not names & {"bench", "bench_engine", "bench_gpu", "soak", "faults", "fuzz", "hostile_table"}
