"""``tern admin report``: the usage report of ``GET /admin/reports/usage`` as a terminal table."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from datetime import UTC, date, datetime
from typing import Any

from gateway.reports.schemas import GROUP_FIELDS, METRICS


def add_report_parser(admin_commands: Any) -> None:
    report = admin_commands.add_parser("report", help="usage and cost per day/model/key/tenant")
    report.add_argument(
        "--from", dest="start", type=date.fromisoformat, help="first UTC day (default: month start)"
    )
    report.add_argument(
        "--to", dest="end", type=date.fromisoformat, help="last UTC day, included (default: today)"
    )
    report.add_argument("--tenant", type=uuid.UUID)
    report.add_argument("--key", type=uuid.UUID)
    report.add_argument("--model")
    report.add_argument("--user", help="only requests with this OpenAI user field")
    report.add_argument("--group-by", default="day", help="comma-separated: day, model, key, tenant, user")
    report.add_argument("--format", choices=["table", "json", "csv"], default="table")
    report.set_defaults(run=cmd_report)


def format_table(report: dict[str, Any], groups: list[str]) -> str:
    columns = [GROUP_FIELDS[g] for g in groups] + list(METRICS)
    totals = {**{c: "" for c in columns}, **report["totals"]}
    if columns[0] not in METRICS:
        totals[columns[0]] = "TOTAL"
    rows = [[str(row[c]) for c in columns] for row in [*report["rows"], totals]]
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(columns)]

    def line(cells: list[str]) -> str:
        return "  ".join(
            cell.rjust(w) if col in METRICS else cell.ljust(w)
            for cell, w, col in zip(cells, widths, columns, strict=True)
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(columns), rule, *(line(r) for r in rows[:-1]), rule, line(rows[-1])])


def cmd_report(args: argparse.Namespace) -> int:
    from gateway.config import Settings
    from gateway.db import create_db_engine, create_sessionmaker
    from gateway.reports.router import parse_group_by, render
    from gateway.reports.service import usage_report

    groups = parse_group_by([args.group_by])
    today = datetime.now(UTC).date()

    async def run() -> dict[str, Any]:
        engine = create_db_engine(Settings())
        try:
            async with create_sessionmaker(engine)() as session:
                return await usage_report(
                    session,
                    start=args.start or today.replace(day=1),
                    end=args.end or today,
                    group_by=groups,
                    tenant_id=args.tenant,
                    key_id=args.key,
                    model=args.model,
                    end_user=args.user,
                )
        finally:
            await engine.dispose()

    report = asyncio.run(run())
    if args.format == "json":
        print(json.dumps(report, indent=2))
    elif args.format == "csv":
        sys.stdout.write(render(report, groups=groups, fmt="csv").body.decode())  # type: ignore[union-attr]
    else:
        print(format_table(report, groups))
    return 0
