"""The ``tern`` command loads only what a subcommand needs: the gateway's never import torch or the
engine's runtime, the engine's never import the gateway."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest


def _modules_after(code: str) -> set[str]:
    """Top-level packages imported by ``code`` in a fresh interpreter."""
    program = (
        textwrap.dedent(code)
        + "\nimport sys; print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return set(result.stdout.split())


def test_gateway_subcommands_never_import_torch() -> None:
    loaded = _modules_after(
        """
        from tern_cli.main import build_parser
        for argv in (["gateway"], ["migrate"], ["admin", "create-tenant", "x"], ["admin", "report"]):
            build_parser().parse_args(argv)
        import gateway.app, gateway.db
        """
    )
    assert "gateway" in loaded
    assert not loaded & {"torch", "triton", "tern_stack"}


@pytest.mark.parametrize("command", ["engine", "quantize"])
def test_engine_subcommands_never_import_the_gateway(command: str) -> None:
    loaded = _modules_after(
        f"""
        from tern_cli import main
        try:
            main([{command!r}, "--help"])
        except SystemExit:
            pass
        """
    )
    assert "engine" in loaded
    assert not loaded & {"gateway", "tern_stack"}


def test_python_dash_m_tern_cli_is_the_tern_command() -> None:
    result = subprocess.run([sys.executable, "-m", "tern_cli", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    for command in ("gateway", "engine", "migrate", "admin", "quantize", "up", "bench"):
        assert command in result.stdout
