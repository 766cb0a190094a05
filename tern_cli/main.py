"""The ``tern`` command.

``tern gateway`` serves the gateway, ``tern migrate`` upgrades the database, ``tern admin ...``
manages tenants and keys directly in the database, ``tern engine ...`` runs an engine,
``tern quantize ...`` writes an INT4 checkpoint, ``tern up`` starts the whole local stack,
``tern status`` says what it runs, ``tern chat`` talks to a model and ``tern bench ...`` runs a
benchmark.

Beside a running ``tern up`` the database commands find its database and secret by themselves
(:mod:`tern_cli.local_stack`); every failure is one line on stderr (:mod:`tern_cli.errors`).

Each subcommand imports only its own side, when it runs: the gateway's commands never import the
engine (so never torch), and ``tern engine`` / ``tern quantize`` never import the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tern_cli.errors import CliError, debug, describe
from tern_cli.local_stack import LocalStack

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

    from gateway.config import Settings


def _settings() -> Settings:
    from gateway.config import Settings

    return Settings()


def use_local_stack(data_dir: Path | None) -> None:
    """Point this process's gateway settings at the ``tern up`` stack in ``data_dir`` (default
    ``TERN_DATA_DIR`` or ``.tern``), for each setting the environment leaves unset.

    Through the environment, so every settings reader in this process (``tern admin report``'s too)
    sees the same values. An explicitly named data dir without a running stack is an error.
    """
    import os

    stack = LocalStack.find(data_dir)
    if data_dir is not None and stack.run_info() is None:
        raise CliError(
            f"no running stack in {stack.data_dir} ({stack.run_file} is missing); start it with `tern up`"
        )
    names = {"database_url": "TERN_DATABASE_URL", "redis_url": "TERN_REDIS_URL", "secret": "TERN_SECRET"}
    for field, value in stack.settings_overrides().items():
        os.environ[names[field]] = value


def _database_url_or_none() -> str | None:
    try:
        return str(_settings().database_url)
    except Exception:
        return None


def cmd_gateway(args: argparse.Namespace) -> int:
    import shutil

    import uvicorn

    from gateway.metrics import prepare_multiprocess_dir

    settings = _settings()
    check_bootstrap_key(settings)
    # Several workers: /metrics must sum them all, not show whichever worker answers the scrape.
    metrics_dir = prepare_multiprocess_dir() if args.workers > 1 else None
    try:
        uvicorn.run(
            "gateway.app:create_app",
            factory=True,
            host=args.host or settings.host,
            port=args.port or settings.port,
            workers=args.workers,
            log_config=None,  # gateway.logging configures JSON logs
            access_log=False,  # the gateway writes its own access log line
            loop="uvloop",
            http="httptools",
            lifespan="on",
        )
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0


def check_bootstrap_key(settings: Any) -> None:
    """Refuse, before serving, a ``TERN_ADMIN_KEY`` that the gateway could never authenticate."""
    from gateway.keys.format import bootstrap_key_problem

    if settings.admin_key is not None:
        problem = bootstrap_key_problem(settings.admin_key.get_secret_value())
        if problem is not None:
            raise CliError(problem)


def cmd_migrate(args: argparse.Namespace) -> int:
    from gateway.db import upgrade_database

    upgrade_database(_settings().database_url, args.revision)
    print(f"database upgraded to {args.revision}")
    return 0


async def _with_session(work: Callable[..., Any]) -> Any:
    """Run ``work(session, settings)`` with every ORM model loaded.

    The models reference each other's tables by name (``audit_log.actor_key_id`` -> ``api_keys``);
    outside the app nothing else imports them all, and the first flush would fail to resolve them.
    """
    from gateway.db import all_models, create_db_engine, create_sessionmaker

    all_models()
    settings = _settings()
    engine = create_db_engine(settings)
    try:
        async with create_sessionmaker(engine)() as session:
            return await work(session, settings)
    finally:
        await engine.dispose()


def cmd_create_tenant(args: argparse.Namespace) -> int:
    from gateway.auth.identity import SYSTEM
    from gateway.tenants.service import create_tenant, snapshot

    async def work(session: AsyncSession, _settings: Settings) -> dict[str, Any]:
        return snapshot(await create_tenant(session, actor=SYSTEM, name=args.name))

    print(json.dumps(asyncio.run(_with_session(work)), indent=2))
    return 0


def cmd_create_key(args: argparse.Namespace) -> int:
    from gateway.auth.identity import SYSTEM
    from gateway.keys.service import create_key, snapshot

    async def work(session: AsyncSession, settings: Settings) -> dict[str, Any]:
        key, plaintext = await create_key(
            session,
            actor=SYSTEM,
            secret=settings.secret_bytes(),
            tenant_id=args.tenant_id,
            kind=args.kind,
            name=args.name,
            models=args.models,
            rpm_limit=args.rpm_limit,
            tpm_limit=args.tpm_limit,
            max_concurrency=args.max_concurrency,
            monthly_token_budget=args.monthly_token_budget,
            expires_at=args.expires_at,
        )
        return {**snapshot(key), "key": plaintext}

    created = asyncio.run(_with_session(work))
    print(json.dumps(created, indent=2))
    print(f"\nThe key is shown only this once: {created['key']}", file=sys.stderr)
    return 0


def _comma_list(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


def _aware_datetime(value: str) -> datetime:
    parsed = datetime.fromisoformat(value)
    if parsed.tzinfo is None:
        raise argparse.ArgumentTypeError("give a timezone, e.g. 2030-01-01T00:00:00Z")
    return parsed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tern", description="Tern: multi-tenant LLM serving.")
    commands = parser.add_subparsers(dest="command", required=True)

    gateway = commands.add_parser("gateway", help="serve the gateway (settings from TERN_* variables)")
    gateway.add_argument("--host", default=None, help="default TERN_HOST or 127.0.0.1")
    gateway.add_argument("--port", type=int, default=None, help="default TERN_PORT or 8080")
    gateway.add_argument("--workers", type=int, default=1)
    gateway.set_defaults(run=cmd_gateway)

    migrate = commands.add_parser("migrate", help="upgrade the database schema (alembic)")
    migrate.add_argument("revision", nargs="?", default="head")
    migrate.set_defaults(run=cmd_migrate, database=True)

    admin = commands.add_parser("admin", help="manage tenants and keys directly in the database")
    admin.set_defaults(database=True)
    admin_commands = admin.add_subparsers(dest="admin_command", required=True)

    tenant = admin_commands.add_parser("create-tenant", help="create a tenant")
    tenant.add_argument("name")
    tenant.set_defaults(run=cmd_create_tenant)

    key = admin_commands.add_parser("create-key", help="create an API key and print it once")
    key.add_argument("--tenant-id", type=uuid.UUID, default=None, help="required for inference keys")
    key.add_argument("--name", required=True)
    key.add_argument("--kind", choices=["inference", "admin"], default="inference")
    key.add_argument("--models", type=_comma_list, default=[], help="comma-separated; empty means all")
    key.add_argument("--rpm-limit", type=int)
    key.add_argument("--tpm-limit", type=int)
    key.add_argument("--max-concurrency", type=int)
    key.add_argument("--monthly-token-budget", type=int)
    key.add_argument("--expires-at", type=_aware_datetime, help="ISO 8601 with a timezone")
    key.set_defaults(run=cmd_create_key)

    from gateway.reports.cli import add_report_parser

    add_report_parser(admin_commands)  # tern admin report
    for database_command in (migrate, *admin_commands.choices.values()):
        database_command.add_argument(
            "--data-dir",
            type=Path,
            default=None,
            metavar="DIR",
            help="the `tern up` stack whose database and secret to use "
            "(default: TERN_DATA_DIR or .tern, when a stack runs there; TERN_* variables win)",
        )

    from tern_cli import chat, status

    status.add_parser(commands)  # tern status
    chat.add_parser(commands)  # tern chat

    for name, (_, help_text) in DELEGATED.items():
        commands.add_parser(name, help=help_text, add_help=False)
    return parser


DELEGATED = {
    "engine": ("engine.cli", "run an inference engine (arguments go to the engine)"),
    "quantize": ("engine.quantize", "write an INT4 (AWQ or RTN) checkpoint the engine loads directly"),
    "up": ("tern_stack.cli", "start Postgres, Redis, an engine and the gateway locally"),
    "bench": ("tern_cli.bench", "benchmarks printing JSON: gateway, engine, kernels, ..."),
}
"""Subcommands whose arguments belong to another module's ``main(argv)``, imported only when used."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args: argparse.Namespace | None = None
    try:
        if argv and argv[0] in DELEGATED:
            import importlib

            return int(importlib.import_module(DELEGATED[argv[0]][0]).main(argv[1:]) or 0)
        args = build_parser().parse_args(argv)
        if getattr(args, "database", False):
            use_local_stack(args.data_dir)
        return int(args.run(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if debug():
            raise
        database_url = _database_url_or_none() if getattr(args, "database", False) else None
        print(f"tern: error: {describe(exc, database_url=database_url)}", file=sys.stderr)
        return 1
