"""PostgreSQL access: the declarative base, the async engine, request sessions and migrations.

The schema is created only by Alembic (``migrations/``, located with :func:`migrations_dir`); the models
here describe it for queries.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Protocol

from fastapi import Depends, Request
from sqlalchemy import MetaData
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase

from gateway.config import Settings

if TYPE_CHECKING:
    from alembic.config import Config  # imported lazily: the hot path never needs alembic

MIGRATIONS_PACKAGE = "migrations"
"""Alembic's script folder, an importable package shipped in the wheel (``migrations/`` in a checkout)."""

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def create_db_engine(settings: Settings) -> AsyncEngine:
    return create_async_engine(
        settings.database_url,
        pool_size=settings.db_pool_size,
        max_overflow=settings.db_pool_size,
        pool_pre_ping=True,
    )


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


class DatabaseState(Protocol):
    """What request sessions need from the app's state (``gateway.wiring.GatewayState``)."""

    sessionmaker: async_sessionmaker[AsyncSession]


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    """One session per request; services commit their own transactions."""
    state: DatabaseState = request.app.state.gateway
    async with state.sessionmaker() as session:
        yield session


DbSession = Annotated[AsyncSession, Depends(get_session)]


def all_models() -> None:
    """Import every domain's ``models`` module so ``Base.metadata`` is complete (Alembic, schema checks)."""
    import importlib
    import pkgutil

    import gateway

    for package in pkgutil.iter_modules(gateway.__path__):
        if package.ispkg and (Path(gateway.__path__[0]) / package.name / "models.py").exists():
            importlib.import_module(f"gateway.{package.name}.models")


def migrations_dir() -> Path:
    """Where the migrations are on disk, found through the import system (works from a wheel)."""
    from importlib import resources

    folder = resources.files(MIGRATIONS_PACKAGE)
    if not isinstance(folder, Path):  # a zip import: Alembic needs real files
        raise RuntimeError(f"the {MIGRATIONS_PACKAGE!r} package must be installed as files, not {folder!r}")
    return folder


def alembic_config(database_url: str) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(migrations_dir()))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade_database(database_url: str, revision: str = "head") -> None:
    """Run ``alembic upgrade`` programmatically (``tern migrate``). Call from sync code only."""
    from alembic import command

    command.upgrade(alembic_config(database_url), revision)


def downgrade_database(database_url: str, revision: str = "base") -> None:
    from alembic import command

    command.downgrade(alembic_config(database_url), revision)
