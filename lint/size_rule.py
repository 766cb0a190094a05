"""The size rule of `make lint`: no module over 400 lines (Python and C, tests included), no Python
function over 80 lines.

Hand-written because no linter we use has it: ruff has no module-length rule at all, and its
nearest function rule (PLR0915, too-many-statements) counts statements, not lines, so a function of
long literals or comments passes it. The rule is what a reader sees: lines.

A function is measured from its ``def`` line to its last line (docstring and comments included,
decorators not); nested functions are measured on their own too. Run as
``python lint/size_rule.py [ROOT] [DIR ...]``; it prints one line per violation and exits 1 if any.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80

# What `make lint` scans: every package, tests included.
DIRS = ("gateway", "engine", "protocol", "bench", "tests", "migrations", "tern_cli", "tern_stack", "lint")
SUFFIXES = (".py", ".c", ".h", ".inc")
SKIP_PARTS = {"__pycache__", ".venv", "node_modules", "build"}

# Reviewed exemptions, "path::qualified.function" -> why. Each must still be over the limit, so a
# stale entry fails too and gets deleted (as the import contract's allow-lists do).
FUNCTION_EXEMPTIONS: dict[str, str] = {
    # A migration is history: it records the schema as it was shipped, and is never edited after.
    "migrations/versions/0002_usage.py::upgrade": "migration: history, not maintained code",
}
MODULE_EXEMPTIONS: dict[str, str] = {}


def source_files(root: Path, dirs: tuple[str, ...] = DIRS) -> Iterator[Path]:
    for name in dirs:
        base = root / name
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            if path.suffix in SUFFIXES and path.is_file() and not SKIP_PARTS.intersection(path.parts):
                yield path


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """Every function and method with its qualified name (``Class.method``, ``outer.inner``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def long_functions(source: str) -> Iterator[tuple[str, int]]:
    """``(qualified name, lines)`` of each Python function over :data:`MAX_FUNCTION_LINES`."""
    for name, node in _functions(ast.parse(source)):
        assert isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        lines = (node.end_lineno or node.lineno) - node.lineno + 1
        if lines > MAX_FUNCTION_LINES:
            yield name, lines


def violations(root: Path, dirs: tuple[str, ...] = DIRS) -> list[str]:
    found: list[str] = []
    exempt_seen: set[str] = set()
    for path in source_files(root, dirs):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        if lines > MAX_MODULE_LINES:
            if rel in MODULE_EXEMPTIONS:
                exempt_seen.add(rel)
            else:
                found.append(f"{rel}: {lines} lines (module limit {MAX_MODULE_LINES})")
        if path.suffix != ".py":
            continue
        for name, count in long_functions(text):
            key = f"{rel}::{name}"
            if key in FUNCTION_EXEMPTIONS:
                exempt_seen.add(key)
            else:
                found.append(f"{key}: {count} lines (function limit {MAX_FUNCTION_LINES})")
    if dirs == DIRS:
        for key in sorted((FUNCTION_EXEMPTIONS.keys() | MODULE_EXEMPTIONS.keys()) - exempt_seen):
            found.append(f"{key}: exempt but no longer over the limit; delete its exemption")
    return found


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parents[1]
    dirs = tuple(argv[1:]) or DIRS
    found = violations(root, dirs)
    for line in found:
        print(line)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
