"""Prices (``/admin/prices``), usage and billing reports (``/admin/reports/*``) and ``GET /v1/usage``.

A tenant-scoped admin key and an inference key only ever see their own tenant's usage.
"""

from __future__ import annotations

import csv
import io
import uuid
from datetime import UTC, date, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response
from pydantic import StringConstraints

from gateway.auth.deps import AdminActor, InferenceKey
from gateway.bounds import Filter, IsoDate, Month, RowId
from gateway.db import DbSession
from gateway.errors import OpenAIError
from gateway.reports import service
from gateway.reports.schemas import GROUP_FIELDS, METRICS, Bill, PriceCreate, PriceList, PriceOut

admin_router = APIRouter(tags=["admin: reports"])
public_router = APIRouter(tags=["usage"])

Format = Literal["json", "csv"]


@admin_router.post("/admin/prices", status_code=201)
async def create_price(body: PriceCreate, actor: AdminActor, session: DbSession) -> PriceOut:
    return PriceOut.model_validate(await service.create_price(session, actor=actor, body=body))


@admin_router.get("/admin/prices")
async def list_prices(_: AdminActor, session: DbSession, model: Filter | None = None) -> PriceList:
    prices = await service.list_prices(session, model=model)
    return PriceList(data=[PriceOut.model_validate(p) for p in prices])


@admin_router.delete("/admin/prices/{price_id}", status_code=204)
async def delete_price(price_id: RowId, actor: AdminActor, session: DbSession) -> Response:
    await service.delete_price(session, actor=actor, price_id=price_id)
    return Response(status_code=204)


_GROUP = "(" + "|".join(GROUP_FIELDS) + ")"
GroupByQuery = Annotated[
    list[Annotated[str, StringConstraints(pattern=f"^{_GROUP}(,{_GROUP})*$")]],
    Query(description="day, model, key, tenant, user (the OpenAI user field): repeated or comma-separated"),
]
EndUser = Annotated[
    str | None,
    StringConstraints(max_length=256, pattern="^[^\\x00]*$"),
    Query(alias="user", description="only requests with this OpenAI user field (empty: without one)"),
]


def parse_group_by(values: list[str]) -> list[str]:
    """``group_by=day,model`` or repeated ``group_by``; order kept, duplicates dropped."""
    groups: list[str] = []
    for value in values:
        for part in value.split(","):
            part = part.strip()
            if not part:
                continue
            if part not in GROUP_FIELDS:
                raise OpenAIError(
                    400, f"group_by must be among {', '.join(GROUP_FIELDS)}; got {part!r}.", param="group_by"
                )
            if part not in groups:
                groups.append(part)
    return groups


REPORT_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The report: JSON, or CSV with format=csv",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/csv": {"schema": {"type": "string"}},
        },
    }
}


def render(report: dict[str, Any], *, groups: list[str], fmt: Format) -> Response | dict[str, Any]:
    if fmt == "json":
        return report
    out = io.StringIO()
    writer = csv.writer(out)
    columns = [GROUP_FIELDS[g] for g in groups] + list(METRICS)
    writer.writerow(columns)
    for row in report["rows"]:
        writer.writerow([row[c] for c in columns])
    return Response(
        out.getvalue(),
        media_type="text/csv; charset=utf-8",
        headers={"content-disposition": 'attachment; filename="usage.csv"'},
    )


async def _report(
    session: DbSession,
    *,
    start: date | None,
    end: date | None,
    tenant: uuid.UUID | None,
    key: uuid.UUID | None,
    model: str | None,
    group_by: list[str],
    fmt: Format,
    end_user: str | None = None,
) -> Response | dict[str, Any]:
    today = datetime.now(UTC).date()
    start = start or today.replace(day=1)
    end = end or today
    # 'to' before 'from' is an empty range: an empty report, not an error.
    groups = parse_group_by(group_by)
    report = await service.usage_report(
        session,
        start=start,
        end=end,
        group_by=groups,
        tenant_id=tenant,
        key_id=key,
        model=model,
        end_user=end_user,
    )
    return render(report, groups=groups, fmt=fmt)


@admin_router.get("/admin/reports/usage", response_model=None, responses=REPORT_RESPONSES)
async def admin_usage_report(
    actor: AdminActor,
    session: DbSession,
    start: Annotated[
        IsoDate | None, Query(alias="from", description="first UTC day (default: month start)")
    ] = None,
    end: Annotated[
        IsoDate | None, Query(alias="to", description="last UTC day, included (default: today)")
    ] = None,
    tenant: uuid.UUID | None = None,
    key: uuid.UUID | None = None,
    model: Filter | None = None,
    group_by: GroupByQuery = ["day"],  # noqa: B006 (FastAPI copies defaults)
    fmt: Annotated[Format, Query(alias="format")] = "json",
    end_user: EndUser = None,
) -> Response | dict[str, Any]:
    if not actor.is_platform:
        if tenant is not None and tenant != actor.tenant_id:
            raise OpenAIError(
                403, "A tenant-scoped admin key can only read its own tenant's usage.", param="tenant"
            )
        tenant = actor.tenant_id
    return await _report(
        session,
        start=start,
        end=end,
        tenant=tenant,
        key=key,
        model=model,
        group_by=group_by,
        fmt=fmt,
        end_user=end_user,
    )


@admin_router.get("/admin/reports/billing")
async def admin_billing(actor: AdminActor, session: DbSession, tenant: uuid.UUID, month: Month) -> Bill:
    if not actor.is_platform and tenant != actor.tenant_id:
        raise OpenAIError(
            403, "A tenant-scoped admin key can only read its own tenant's bill.", param="tenant"
        )
    return await service.monthly_bill(session, tenant_id=tenant, month=service.parse_month(month))


@public_router.get("/v1/usage", response_model=None, responses=REPORT_RESPONSES)
async def own_usage(
    key: InferenceKey,
    session: DbSession,
    start: Annotated[IsoDate | None, Query(alias="from")] = None,
    end: Annotated[IsoDate | None, Query(alias="to")] = None,
    key_id: Annotated[uuid.UUID | None, Query(alias="key")] = None,
    model: Filter | None = None,
    group_by: GroupByQuery = ["day"],  # noqa: B006
    fmt: Annotated[Format, Query(alias="format")] = "json",
    end_user: EndUser = None,
) -> Response | dict[str, Any]:
    """The calling key's tenant only; ``group_by=tenant`` is allowed but shows just that tenant."""
    return await _report(
        session,
        start=start,
        end=end,
        tenant=key.tenant_id,
        key=key_id,
        model=model,
        group_by=group_by,
        fmt=fmt,
        end_user=end_user,
    )
