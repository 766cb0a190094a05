"""Soft thresholds: when a budget's settled usage first reaches its ``alert_ratio`` in a period, one
audit row (``budget.alert``) and one signed webhook call (``TERN_ALERT_WEBHOOK_URL``), retried with
backoff until the receiver answers 2xx; and the ``tern_budget_used_ratio{scope}`` gauge after every
settlement.

"First" is decided in Redis: the settlement that takes the counter past the threshold sets a flag in
the period's counter hash (``HSETNX``), so exactly one gateway process sends each alert (once more
only if Redis lost that period's counter). The webhook body is JSON; its signature is
``x-tern-signature: t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>.<body>" keyed by
TERN_ALERT_WEBHOOK_SECRET>``; ``x-tern-event-id`` stays the same across retries, for deduplication.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, date, datetime
from datetime import time as day_time
from typing import Any

import httpx
from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.audit.service import record
from gateway.auth.identity import SYSTEM
from gateway.budgets.periods import period_start, resets_at
from gateway.budgets.rules import BudgetRule, from_nano
from gateway.metrics import budget_used_ratio_by

log = logging.getLogger(__name__)


class AlertSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TERN_ALERT_", extra="ignore")

    webhook_url: str | None = Field(None, description="Where budget alerts are POSTed (none: audit only).")
    webhook_secret: SecretStr | None = Field(None, description="HMAC-SHA256 key of the webhook signature.")
    webhook_retries: int = Field(6, ge=0, description="Retries after a failed call (no answer, or not 2xx).")
    webhook_backoff_s: float = Field(0.5, gt=0, description="First retry's delay; doubled for each next.")
    webhook_timeout_s: float = Field(5.0, gt=0)

    @model_validator(mode="after")
    def _signed(self) -> AlertSettings:
        if self.webhook_url and self.webhook_secret is None:
            raise ValueError("TERN_ALERT_WEBHOOK_URL needs TERN_ALERT_WEBHOOK_SECRET: webhooks are signed")
        return self


def sign(secret: bytes, timestamp: int, body: bytes) -> str:
    """The ``x-tern-signature`` value of ``body`` sent at ``timestamp``."""
    digest = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


@dataclass(frozen=True, slots=True)
class Owner:
    """Whose budget it is: ``scope`` is ``key`` or ``tenant`` (or either per model)."""

    scope: str
    scope_name: str
    tenant_id: str | None
    key_id: str | None


def _amount(rule: BudgetRule, value: int) -> str:
    return str(value) if rule.metric == "tokens" else format(from_nano(value), "f")


def used_ratio(label: str, ratio: float) -> None:
    """The gauge, after a settlement: settled usage over the limit in the current period, per
    ``<scope>:<metric>:<period>``."""
    budget_used_ratio_by(label).set(ratio)


class BudgetAlerts:
    def __init__(self, *, sessionmaker: async_sessionmaker[AsyncSession], settings: AlertSettings) -> None:
        self.sessionmaker = sessionmaker
        self.settings = settings

    def event(self, owner: Owner, rule: BudgetRule, used: int, day: date) -> dict[str, Any]:
        reset = resets_at(rule.period, day)
        start = datetime.combine(period_start(rule.period, day), day_time(0), tzinfo=UTC)
        return {
            "id": uuid.uuid4().hex,
            "type": "budget.threshold_crossed",
            "created_at": datetime.now(UTC).isoformat(),
            "budget": {
                "id": rule.budget_id,
                "scope": owner.scope,
                "tenant_id": owner.tenant_id,
                "key_id": owner.key_id,
                "metric": rule.metric,
                "period": rule.period,
                "limit": _amount(rule, rule.limit),
                "alert_at": _amount(rule, rule.alert_at or 0),
                "used": _amount(rule, used),
                "used_ratio": round(used / rule.limit, 6) if rule.limit else 1.0,
                "period_start": start.isoformat(),
                "resets_at": None if reset is None else reset.isoformat(),
            },
        }

    async def __call__(self, owner: Owner, rule: BudgetRule, used: int, day: date) -> None:
        """One threshold crossing: the audit row, then the webhook (retried); never raises."""
        event = self.event(owner, rule, used, day)
        try:
            async with self.sessionmaker() as session:
                record(
                    session,
                    actor=SYSTEM,
                    tenant_id=uuid.UUID(owner.tenant_id) if owner.tenant_id else None,
                    action="budget.alert",
                    object_type="budget",
                    object_id=str(rule.budget_id) if rule.budget_id else f"{owner.scope_name}:{rule.name}",
                    before=None,
                    after=event,
                )
                await session.commit()
        except Exception:
            log.exception("budget alert %s could not be audited", event["id"])
        if self.settings.webhook_url:
            await self.deliver(event)

    async def deliver(self, event: dict[str, Any]) -> bool:
        """POST the event until the receiver answers 2xx, at most ``1 + webhook_retries`` times."""
        settings = self.settings
        assert settings.webhook_url is not None and settings.webhook_secret is not None
        body = json.dumps(event, separators=(",", ":")).encode()
        secret = settings.webhook_secret.get_secret_value().encode()
        async with httpx.AsyncClient(timeout=settings.webhook_timeout_s) as client:
            for attempt in range(settings.webhook_retries + 1):
                if attempt:
                    await asyncio.sleep(settings.webhook_backoff_s * 2 ** (attempt - 1))
                headers = {
                    "content-type": "application/json",
                    "x-tern-event-id": event["id"],
                    "x-tern-signature": sign(secret, int(time.time()), body),
                }
                try:
                    response = await client.post(settings.webhook_url, content=body, headers=headers)
                except httpx.HTTPError as exc:
                    log.warning("budget alert %s: attempt %d failed: %s", event["id"], attempt + 1, exc)
                    continue
                if response.is_success:
                    return True
                log.warning(
                    "budget alert %s: attempt %d got %d", event["id"], attempt + 1, response.status_code
                )
        log.error("budget alert %s was not delivered to the webhook", event["id"])
        return False
