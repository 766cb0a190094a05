"""The ``tern`` command.

``tern gateway`` serves the gateway, ``tern migrate`` upgrades the database, ``tern admin ...``
manages tenants and keys directly in the database, ``tern engine ...`` runs an engine,
``tern quantize ...`` writes an INT4 checkpoint, ``tern up`` starts the whole local stack and
``tern bench ...`` runs a benchmark.

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
from typing import Any


def _settings():
    from gateway.config import Settings

    return Settings()


def cmd_gateway(args: argparse.Namespace) -> int:
    import shutil

    import uvicorn

    from gateway.metrics import prepare_multiprocess_dir

    settings = _settings()
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


def cmd_migrate(args: argparse.Namespace) -> int:
    from gateway.db import upgrade_database

    upgrade_database(_settings().database_url, args.revision)
    print(f"database upgraded to {args.revision}")
    return 0


async def _with_session(work: Callable[..., Any]) -> Any:
    from gateway.db import create_db_engine, create_sessionmaker

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

    async def work(session, _settings) -> dict[str, Any]:
        return snapshot(await create_tenant(session, actor=SYSTEM, name=args.name))

    print(json.dumps(asyncio.run(_with_session(work)), indent=2))
    return 0


def cmd_create_key(args: argparse.Namespace) -> int:
    from gateway.auth.identity import SYSTEM
    from gateway.keys.service import create_key, snapshot

    async def work(session, settings) -> dict[str, Any]:
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
    migrate.set_defaults(run=cmd_migrate)

    admin = commands.add_parser("admin", help="manage tenants and keys directly in the database")
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
    if argv and argv[0] in DELEGATED:
        import importlib

        return int(importlib.import_module(DELEGATED[argv[0]][0]).main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    from gateway.exceptions import DomainError

    try:
        return args.run(args)
    except DomainError as exc:  # a service's refusal: not found, conflict, invalid input
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
