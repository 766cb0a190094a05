"""`make lint`'s own rules fail where they should: a dead function (vulture), a module over 400 lines
or a function over 80 (lint/size_rule.py), and a type error on the model-loading path (mypy).

Each check runs on a small example injected in a temporary directory, under the repository's own
configuration (pyproject.toml's [tool.vulture] and [tool.mypy]), so it takes seconds, not a run
over the whole repository (that is `make lint`).
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
BIN = Path(sys.executable).parent

sys.path.insert(0, str(ROOT / "lint"))
import size_rule  # noqa: E402  (lint/ is a folder of scripts, not a package)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


# --- dead code ---------------------------------------------------------------------------------------

DEAD_CODE_EXAMPLE = """
    from fastapi import APIRouter
    from pydantic import BaseModel, field_validator

    router = APIRouter()


    class Thing(BaseModel):
        name: str

        @field_validator("name")
        @classmethod
        def _not_blank(cls, value: str) -> str:  # pydantic calls it: not dead
            if not value.strip():
                raise ValueError(f"{cls.__name__}: a blank name")
            return value


    @router.post("/things")
    def create_thing(thing: Thing) -> str:  # FastAPI calls it: not dead
        return used_helper(thing.name)


    def used_helper(name: str) -> str:
        return name


    def forgotten_helper() -> int:  # nothing calls it: dead
        return 1
"""


def _vulture(*paths: Path) -> subprocess.CompletedProcess[str]:
    # From the repository root, so vulture reads [tool.vulture] (confidence, framework decorators).
    command = [str(BIN / "vulture"), *map(str, paths), str(ROOT / "lint" / "vulture_whitelist.py")]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_vulture_fails_on_an_injected_dead_function_and_spares_framework_entry_points(
    tmp_path: Path,
) -> None:
    module = _write(tmp_path / "things.py", DEAD_CODE_EXAMPLE)
    result = _vulture(module)
    assert result.returncode != 0, result.stdout
    assert "forgotten_helper" in result.stdout
    for spared in ("create_thing", "_not_blank", "used_helper", "Thing"):
        assert spared not in result.stdout, result.stdout


def test_vulture_passes_once_the_dead_function_is_gone(tmp_path: Path) -> None:
    alive = DEAD_CODE_EXAMPLE.split("    def forgotten_helper")[0]
    result = _vulture(_write(tmp_path / "things.py", alive))
    assert result.returncode == 0, result.stdout


# --- sizes -------------------------------------------------------------------------------------------


def _function(name: str, lines: int) -> str:
    """A function of exactly ``lines`` lines, ``def`` line included."""
    body = "".join(f"    x{i} = {i}\n" for i in range(lines - 2))
    return f"def {name}() -> int:\n{body}    return 0\n"


def test_size_rule_fails_on_an_injected_401_line_module_and_passes_400(tmp_path: Path) -> None:
    _write(tmp_path / "pkg" / "at_limit.py", "x = 0\n" * 400)
    _write(tmp_path / "pkg" / "over_limit.py", "x = 0\n" * 401)
    _write(tmp_path / "pkg" / "kernel.c", "/* C counts too */\n" * 401)
    found = size_rule.violations(tmp_path, ("pkg",))
    assert found == [
        "pkg/kernel.c: 401 lines (module limit 400)",
        "pkg/over_limit.py: 401 lines (module limit 400)",
    ]
    result = subprocess.run(
        [sys.executable, str(ROOT / "lint" / "size_rule.py"), str(tmp_path), "pkg"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1 and "over_limit.py: 401 lines" in result.stdout


def test_size_rule_fails_on_a_function_over_80_lines_nested_or_in_a_class(tmp_path: Path) -> None:
    method = textwrap.indent(_function("long_method", 81), "    ")
    source = _function("at_limit", 80) + _function("too_long", 81) + f"class Thing:\n{method}"
    _write(tmp_path / "pkg" / "functions.py", source)
    assert size_rule.violations(tmp_path, ("pkg",)) == [
        "pkg/functions.py::too_long: 81 lines (function limit 80)",
        "pkg/functions.py::Thing.long_method: 81 lines (function limit 80)",
    ]


def test_every_size_exemption_is_still_needed_and_says_why() -> None:
    assert size_rule.violations(ROOT) == []  # a stale exemption is a violation too
    for key, why in {**size_rule.FUNCTION_EXEMPTIONS, **size_rule.MODULE_EXEMPTIONS}.items():
        assert why.strip(), key


# --- types on the model-loading path --------------------------------------------------------------

LOAD_PATH = ("engine.loader.load", "engine.models.llama", "engine.layers.quant.awq", "engine.quantize")
TYPE_ERROR = """
    def layer_count(config: dict[str, int]) -> str:
        return config["num_hidden_layers"]  # an int returned as a str
"""


def _mypy_on(tmp_path: Path, module: str, source: str) -> subprocess.CompletedProcess[str]:
    """mypy under the repository's configuration on one injected file that mypy names ``module``
    (its packages are made in ``tmp_path``), so the per-module overrides apply as to a real one."""
    parts = module.split(".")
    for depth in range(1, len(parts)):
        _write(tmp_path.joinpath(*parts[:depth], "__init__.py"), "")
    path = _write(tmp_path.joinpath(*parts[:-1], f"{parts[-1]}.py"), source)
    command = [str(BIN / "mypy"), "--config-file", str(PYPROJECT), "--cache-dir", str(tmp_path / ".cache")]
    return subprocess.run(
        [*command, str(path.relative_to(tmp_path))], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )


def test_mypy_fails_on_an_injected_type_error_on_the_load_path(tmp_path: Path) -> None:
    result = _mypy_on(tmp_path, "engine.loader.injected", TYPE_ERROR)
    assert result.returncode == 1, result.stdout
    assert "[return-value]" in result.stdout


def test_the_triton_kernels_let_only_untyped_defs_through(tmp_path: Path) -> None:
    untyped = "def kernel(x_ptr, n):\n    return n\n"
    assert _mypy_on(tmp_path / "a", "engine.kernels.injected", untyped).returncode == 0
    result = _mypy_on(tmp_path / "b", "engine.kernels.injected", untyped + textwrap.dedent(TYPE_ERROR))
    assert result.returncode == 1 and "[return-value]" in result.stdout, result.stdout


@pytest.mark.parametrize("module", LOAD_PATH)
def test_no_module_on_the_load_path_is_exempt(module: str) -> None:
    from mypy.config_parser import parse_config_file
    from mypy.options import Options

    options = Options()
    parse_config_file(options, lambda: None, str(PYPROJECT), io.StringIO(), io.StringIO())
    assert options.per_module_options, "the [[tool.mypy.overrides]] were not read"
    options.build_per_module_cache()  # as mypy's main does: clone_for_module reads it
    effective = options.clone_for_module(module)
    assert not effective.ignore_errors
    assert not effective.disabled_error_codes


def test_test_modules_have_unique_names() -> None:
    """pytest imports test modules by their file name (the test folders are not packages), so two
    files of one name in different folders stop the whole run at collection."""
    names: dict[str, Path] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        assert path.name not in names, f"{path} and {names[path.name]} share a name"
        names[path.name] = path
