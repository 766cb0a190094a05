"""The boundaries between packages, checked on the source (no import is executed).

- ``protocol`` (the contract both sides speak) imports neither side, nor torch or a web framework;
- ``engine`` and ``gateway`` never import each other;
- gateway's packages (keys, limits, proxy, ...) import each other without cycles.

Modules are read with ``ast``, so imports inside functions count too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FORBIDDEN = {
    "protocol": ("engine", "gateway", "torch", "triton", "fastapi", "starlette", "sqlalchemy", "redis"),
    "engine": ("gateway",),
    "gateway": ("engine", "torch", "triton"),
}
# Package cycles inside gateway/ that are known and being removed; none may be added.
KNOWN_GATEWAY_CYCLES: list[set[str]] = [{"keys", "audit", "tenants"}, {"limits", "proxy", "usage", "reports"}]


def imported_modules(source: str) -> Iterator[str]:
    """Every absolute module an import statement names, at any depth of the module."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def violations(package: str, path: str, source: str) -> list[str]:
    return [
        f"{path} imports {module}"
        for module in imported_modules(source)
        for banned in FORBIDDEN[package]
        if module == banned or module.startswith(banned + ".")
    ]


def sources(package: str) -> Iterator[tuple[str, str]]:
    for path in sorted((ROOT / package).rglob("*.py")):
        yield path.relative_to(ROOT).as_posix(), path.read_text()


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_does_not_import_what_it_must_not(package: str) -> None:
    found = [v for path, source in sources(package) for v in violations(package, path, source)]
    assert not found, "\n".join(found)


def test_the_checker_sees_imports_at_any_depth() -> None:
    source = "import os\ndef f():\n    from gateway.keys import service\n    import torch.nn as nn\n"
    assert violations("protocol", "protocol/x.py", source) == [
        "protocol/x.py imports gateway.keys",
        "protocol/x.py imports torch.nn",
    ]
    assert violations("engine", "engine/x.py", "from gateway import app") == ["engine/x.py imports gateway"]
    assert violations("engine", "engine/x.py", "import gatewayish") == []


def gateway_package_graph() -> dict[str, set[str]]:
    """gateway.<a> -> gateway.<b> edges, <a> being a subpackage or a top-level module."""
    graph: dict[str, set[str]] = {}
    for path, source in sources("gateway"):
        src = Path(path).parts[1].removesuffix(".py")
        for module in imported_modules(source):
            parts = module.split(".")
            if parts[0] == "gateway" and len(parts) > 1 and parts[1] != src:
                graph.setdefault(src, set()).add(parts[1])
    return graph


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_gateway_packages_have_no_new_cycles() -> None:
    found = cycles(gateway_package_graph())
    new = [c for c in found if not any(c <= known for known in KNOWN_GATEWAY_CYCLES)]
    assert not new, f"import cycles between gateway packages: {new}"
