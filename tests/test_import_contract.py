"""The import contract between Tern's packages, checked on the source files with :mod:`ast`.

``protocol`` is the wire contract both sides speak, so it imports neither side nor anything heavy;
``engine`` and ``gateway`` never import each other (a gateway pod needs no torch, an engine needs no
gateway); gateway's subpackages form no import cycles. The allow-lists below record today's
exceptions; each entry must still be needed, so a stale one fails too and gets deleted.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# gateway -> engine: none. The `tern` command, which runs both, is its own package (tern_cli/). A file
# listed here would be an exception to record, and must still need it.
GATEWAY_FILES_ALLOWED_TO_NAME_ENGINE: set[str] = set()

# Import cycles between gateway's first-level children: none. The proxy reaches limits and usage only
# through the Admitter and completion hooks that gateway/wiring.py hands it (proxy/outcome.py), and
# authentication lives in gateway/auth/, which no domain package is imported by. A cycle found later is
# recorded here as a sorted tuple of its strongly connected component, with why it cannot be avoided.
KNOWN_CYCLES: set[tuple[str, ...]] = set()

PROTOCOL_FORBIDDEN = ("torch", "triton", "fastapi", "starlette", "engine", "gateway")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _python_files(package: str) -> list[Path]:
    return sorted(p for p in (ROOT / package).rglob("*.py") if "__pycache__" not in p.parts)


def _all_modules() -> set[str]:
    return {_module_name(p) for package in ("protocol", "engine", "gateway") for p in _python_files(package)}


def imports_of(source: str, module: str, *, is_package: bool = False) -> set[str]:
    """Every module ``source`` imports, at any depth (inside functions and ``TYPE_CHECKING`` too).

    ``from a.b import c`` yields ``a.b`` and ``a.b.c`` (``c`` may be a submodule); relative
    imports are resolved against ``module``; ``importlib.import_module("x")`` with a literal
    counts as an import of ``x``.
    """
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
        elif (
            isinstance(node, ast.Call)
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


def modules_named(source: str, known: set[str]) -> set[str]:
    """String constants that are exactly a dotted module name: what a registry hands to importlib later.

    Bare package names are left out: ``"engine"`` is also a subcommand, a service, a metric label.
    """
    return {
        node.value
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and "." in node.value
        and node.value in known
    }


def _in_package(name: str, packages: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def violations(source: str, module: str, forbidden: Iterable[str], known: set[str] = frozenset()) -> set[str]:
    """The forbidden modules ``source`` imports or names by string."""
    forbidden = tuple(forbidden)
    used = imports_of(source, module) | modules_named(source, known)
    return {name for name in used if _in_package(name, forbidden)}


def _violations_by_file(package: str, forbidden: Iterable[str]) -> dict[str, set[str]]:
    known = _all_modules()
    found = {}
    for path in _python_files(package):
        bad = violations(path.read_text(), _module_name(path), forbidden, known)
        if bad:
            found[path.relative_to(ROOT).as_posix()] = bad
    return found


# --------------------------------------------------------------------------- the checker can fail


def test_checker_detects_forbidden_imports_in_synthetic_source() -> None:
    source = (
        "import os\n"
        "from protocol.rpc import GenerateRequest\n"
        "def later():\n"
        "    from engine.server import create_app\n"
        "    import importlib\n"
        "    return importlib.import_module('torch.nn')\n"
    )
    assert violations(source, "gateway.proxy.relay", ["engine"]) == {
        "engine.server",
        "engine.server.create_app",
    }
    assert violations(source, "gateway.proxy.relay", ["torch"]) == {"torch.nn"}
    assert not violations("import engineering\nfrom gateways import x\n", "m", ["engine", "gateway"])
    assert violations("from .. import relay\n", "gateway.limits.admission", ["gateway.proxy"]) == set()
    assert violations("from ...proxy import relay\n", "gateway.limits.sub.mod", ["gateway.proxy"]) == {
        "gateway.proxy",
        "gateway.proxy.relay",
    }
    registry = "RUN = {'engine': 'engine.cli', 'help': 'run engine.cli'}\n"
    assert violations(registry, "gateway.cli", ["engine"], known={"engine", "engine.cli"}) == {"engine.cli"}


def test_cycle_finder_detects_a_synthetic_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == {("a", "b", "c")}
    assert _cycles({"a": {"b"}, "b": set()}) == set()


# --------------------------------------------------------------------------- the real files


def test_protocol_imports_neither_side_nor_heavy_libraries() -> None:
    assert _python_files("protocol"), "protocol/ has no source files: is ROOT right?"
    assert _violations_by_file("protocol", PROTOCOL_FORBIDDEN) == {}


def test_importing_protocol_loads_neither_side() -> None:
    """The AST check, end to end: transitive imports included."""
    code = (
        "import sys, protocol.rpc, protocol.openai.errors, protocol.openai.requests, "
        "protocol.openai.responses\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {PROTOCOL_FORBIDDEN!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_engine_never_imports_gateway() -> None:
    assert _violations_by_file("engine", ["gateway"]) == {}


def test_gateway_never_imports_engine() -> None:
    found = _violations_by_file("gateway", ["engine"])
    assert set(found) - GATEWAY_FILES_ALLOWED_TO_NAME_ENGINE == set(), found
    stale = GATEWAY_FILES_ALLOWED_TO_NAME_ENGINE - set(found)
    assert not stale, f"no longer import engine: remove from GATEWAY_FILES_ALLOWED_TO_NAME_ENGINE: {stale}"


def _gateway_node(module: str, nodes: set[str]) -> str | None:
    """gateway's first-level child (subpackage or top-level module) that ``module`` belongs to."""
    parts = module.split(".")
    if parts[0] != "gateway" or len(parts) < 2 or parts[1] not in nodes:
        return None
    return parts[1]


def _gateway_graph() -> dict[str, set[str]]:
    paths = _python_files("gateway")
    nodes = {p.relative_to(ROOT / "gateway").parts[0].removesuffix(".py") for p in paths} - {"__init__"}
    graph: dict[str, set[str]] = {node: set() for node in nodes}
    for path in paths:
        module = _module_name(path)
        source_node = _gateway_node(module, nodes)
        if source_node is None:
            continue
        for name in imports_of(path.read_text(), module, is_package=path.name == "__init__.py"):
            target = _gateway_node(name, nodes)
            if target is not None and target != source_node:
                graph[source_node].add(target)
    return graph


def _strongly_connected(graph: dict[str, set[str]]) -> Iterator[set[str]]:
    """Tarjan's algorithm (graphs here have a few dozen nodes: recursion is fine)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return iter(components)


def _cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """Each group of nodes that import each other, directly or around a loop, as a sorted tuple."""
    return {tuple(sorted(c)) for c in _strongly_connected(graph) if len(c) > 1}


def test_no_import_cycles_between_gateway_subpackages() -> None:
    graph = _gateway_graph()
    assert {"proxy", "limits", "keys", "app"} <= set(graph), sorted(graph)
    cycles = _cycles(graph)
    new = cycles - KNOWN_CYCLES
    edges = {node: sorted(targets) for node, targets in sorted(graph.items())}
    assert not new, f"new import cycles in gateway/: {sorted(new)}; edges: {edges}"
    gone = KNOWN_CYCLES - cycles
    assert not gone, f"these cycles are gone: remove them from KNOWN_CYCLES: {sorted(gone)}"


def test_engine_core_speaks_its_own_types_not_the_wire() -> None:
    """docs/architecture.md: the core takes and returns its own dataclasses; engine/serving converts."""
    assert _python_files("engine/core"), "engine/core has no source files"
    assert _violations_by_file("engine/core", ("protocol",)) == {}


# --------------------------------------------------------------------------- the engine, one way

ENGINE_LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"cli"}),
    frozenset({"serving", "quantize"}),
    frozenset({"core"}),
    frozenset({"loader", "structured"}),
    frozenset({"models", "metrics", "tokenizer"}),
    frozenset({"layers", "cache", "model_config", "chat_template"}),
    frozenset({"config"}),
    frozenset({"cpu", "kernels", "errors", "families"}),
)
"""engine's first-level children (subpackages and modules), top to bottom: a node imports only nodes
in layers below its own (docs/architecture.md). The step context sits in ``layers`` (``layers/context.py``),
so the layers import nothing above them; ``cache`` sees sequences through its own view
(``cache/sequence_view.py``); ``RequestError`` sits in ``errors`` and ``ToolCall`` in ``structured``,
which the core imports. A new child is placed here, or the test fails."""

ENGINE_GRAPH_DOC = ROOT / "docs" / "architecture.md"
_GRAPH_BLOCK = re.compile(r"<!-- engine-imports -->\s*```text\n(.*?)```", re.DOTALL)


def _engine_graph() -> dict[str, set[str]]:
    """engine's first-level children and the ones each imports (any depth, lazy imports included)."""
    paths = _python_files("engine")
    nodes = {p.relative_to(ROOT / "engine").parts[0].removesuffix(".py") for p in paths} - {"__init__"}
    graph: dict[str, set[str]] = {node: set() for node in nodes}
    for path in paths:
        module = _module_name(path)
        parts = module.split(".")
        if len(parts) < 2:
            continue
        for name in imports_of(path.read_text(), module, is_package=path.name == "__init__.py"):
            target = name.split(".")
            if target[0] == "engine" and len(target) > 1 and target[1] in nodes and target[1] != parts[1]:
                graph[parts[1]].add(target[1])
    return graph


def upward_arrows(graph: dict[str, set[str]], layers: tuple[frozenset[str], ...]) -> set[tuple[str, str]]:
    """Arrows from a node to one in its own layer or a layer above it."""
    rank = {node: i for i, layer in enumerate(layers) for node in layer}
    return {(a, b) for a, targets in graph.items() for b in targets if rank[b] <= rank[a]}


def test_upward_arrow_finder_detects_a_synthetic_one() -> None:
    layers = (frozenset({"core"}), frozenset({"layers"}), frozenset({"cpu"}))
    assert upward_arrows({"core": {"layers", "cpu"}, "layers": {"cpu"}, "cpu": set()}, layers) == set()
    assert upward_arrows({"core": set(), "layers": {"core"}, "cpu": {"cpu"}}, layers) == {
        ("layers", "core"),
        ("cpu", "cpu"),
    }


def test_engine_packages_are_all_placed_and_import_only_downward() -> None:
    graph = _engine_graph()
    assert {"core", "layers", "models", "cache", "cpu"} <= set(graph), sorted(graph)
    placed = set().union(*ENGINE_LAYERS)
    assert not set(graph) - placed, f"place these in ENGINE_LAYERS: {sorted(set(graph) - placed)}"
    assert not placed - set(graph), (
        f"gone from engine/: remove from ENGINE_LAYERS: {sorted(placed - set(graph))}"
    )
    assert not _cycles(graph), f"import cycles in engine/: {sorted(_cycles(graph))}"
    edges = {node: sorted(targets) for node, targets in sorted(graph.items())}
    assert not upward_arrows(graph, ENGINE_LAYERS), (
        f"upward arrows: {sorted(upward_arrows(graph, ENGINE_LAYERS))}; {edges}"
    )


def engine_graph_text(graph: dict[str, set[str]]) -> str:
    """The arrows as docs/architecture.md lists them: one line per importing node, top layer first."""
    order = [node for layer in ENGINE_LAYERS for node in sorted(layer)]
    width = max(map(len, order))
    return "".join(
        f"{node:<{width}} -> {' '.join(sorted(graph[node], key=order.index))}\n"
        for node in order
        if graph.get(node)
    )


def test_docs_draw_the_engine_arrows_the_code_has() -> None:
    match = _GRAPH_BLOCK.search(ENGINE_GRAPH_DOC.read_text())
    assert match, "docs/architecture.md has no <!-- engine-imports --> block"
    expected = engine_graph_text(_engine_graph())
    assert match.group(1) == expected, f"update docs/architecture.md's engine arrows to:\n{expected}"


# --------------------------------------------------------------------------- top-level packages

PRODUCT_PACKAGES = ("protocol", "engine", "gateway", "tern_stack")


def test_no_product_package_imports_the_benchmarks() -> None:
    """bench/ sits above everything: it may import any package, none imports it (tern_cli/bench.py
    names its modules by string, to run them)."""
    assert _python_files("bench"), "bench/ has no source files"
    for package in PRODUCT_PACKAGES:
        assert _violations_by_file(package, ["bench"]) == {}, package


def test_the_gateway_never_imports_the_local_stack_or_the_command() -> None:
    """tern_stack and tern_cli run the gateway; the gateway (and its benchmarks' old home) never
    reaches back up to them."""
    assert _violations_by_file("gateway", ["tern_stack", "tern_cli"]) == {}
    assert _violations_by_file("engine", ["tern_stack", "tern_cli"]) == {}
