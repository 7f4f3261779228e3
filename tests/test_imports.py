"""The product's imports run one way: no module imports itself through others (a circle
means a module is missing), nothing in the server imports the trainer, and the trainer
uses nothing of the server but its sampler (the in-process loader samples with it).
Every import counts, also one inside a function or under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("protos", "partitioner", "sampling_server", "trainer_client")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The product modules ``name`` imports: ``from pkg import sub`` names the submodule
    ``pkg.sub`` when it is one, else the package."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - (node.level - 1)]
                base = ".".join(pkg + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names} & known
            found.update(subs)
            if len(subs) < len(node.names):
                found.add(base)
    return {m for m in found if m in known and m != name}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = product_modules()
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_itself_through_others(graph: dict[str, set[str]]) -> None:
    assert _cycles(graph) == []


def test_the_server_never_imports_the_trainer(graph: dict[str, set[str]]) -> None:
    crossing = sorted((m, i) for m, deps in graph.items() if m.startswith("sampling_server")
                      for i in deps if i.startswith("trainer_client"))
    assert crossing == []


def test_the_trainer_uses_only_the_server_s_sampler(graph: dict[str, set[str]]) -> None:
    crossing = sorted((m, i) for m, deps in graph.items() if m.startswith("trainer_client")
                      for i in deps if i.startswith("sampling_server")
                      and i != "sampling_server.sampler" and not i.startswith("sampling_server.sampler."))
    assert crossing == []


def test_the_lower_floors_import_no_upper_one(graph: dict[str, set[str]]) -> None:
    """protos imports nothing of the others; partitioner only protos."""
    floors = {"protos": set(), "partitioner": {"protos"}}
    bad = sorted((m, i) for m, deps in graph.items() for pkg, allowed in floors.items()
                 if m.split(".")[0] == pkg for i in deps
                 if i.split(".")[0] not in allowed | {pkg})
    assert bad == []


def test_the_check_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
