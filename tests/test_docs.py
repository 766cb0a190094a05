"""The docs keep up with the code: every setting and flag is in the configuration reference, links resolve."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest
from pydantic import AliasChoices
from pydantic_settings import BaseSettings

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DOC = (ROOT / "docs" / "configuration.md").read_text()
MARKDOWN_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _settings_classes() -> list[type[BaseSettings]]:
    """Every pydantic-settings class of the gateway (each domain keeps its own ``config.py``)."""
    for path in sorted((ROOT / "gateway").rglob("config.py")):
        importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
    found: list[type[BaseSettings]] = []
    pending = list(BaseSettings.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__module__.startswith("gateway."):
            found.append(cls)
    return found


def _env_names(cls: type[BaseSettings]) -> list[str]:
    prefix = cls.model_config.get("env_prefix", "")
    names = []
    for field_name, field in cls.model_fields.items():
        alias = field.validation_alias
        if isinstance(alias, AliasChoices):
            names.extend(str(choice) for choice in alias.choices if str(choice).isupper())
        else:
            names.append(f"{prefix}{field_name}".upper())
    return names


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    return [
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    ]


def test_every_gateway_setting_is_documented() -> None:
    classes = _settings_classes()
    assert {cls.__name__ for cls in classes} >= {"Settings", "LimitsSettings", "UsageSettings"}
    missing = [name for cls in classes for name in _env_names(cls) if f"`{name}`" not in CONFIG_DOC]
    assert not missing, f"add to docs/configuration.md: {missing}"


def test_every_tern_up_flag_is_documented() -> None:
    from tern_stack.cli import build_parser

    missing = [flag for flag in _flags(build_parser()) if f"`{flag}" not in CONFIG_DOC]
    assert not missing, f"add to docs/configuration.md: {missing}"


def test_every_engine_flag_is_documented() -> None:
    from engine.cli import build_parser

    parser = build_parser()
    missing = [flag for flag in _flags(parser) if f"`{flag}" not in CONFIG_DOC]
    assert not missing, f"add to docs/configuration.md: {missing}"


@pytest.mark.parametrize("markdown", MARKDOWN_FILES, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_resolve(markdown: Path) -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", markdown.read_text())
    broken = [link for link in links if "://" not in link and not (markdown.parent / link).resolve().exists()]
    assert not broken, f"{markdown.name} links to missing files: {broken}"
