"""The ``tern`` command (console script ``tern``, or ``python -m tern_cli``); see :mod:`tern_cli.main`."""

from tern_cli.main import main

__all__ = ["main"]
