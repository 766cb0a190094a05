"""Turning a bearer token into an :class:`AuthenticatedKey`.

Cost per request: a format/checksum check, then either a cache hit or one indexed lookup
(``api_keys.secret_hash`` is unique). The in-process cache lives at most ``key_cache_ttl_s``
(<= 0.9 s, default 0.5 s, counted from when the lookup started; concurrent misses share one query),
so a revocation made through any gateway process is honoured by every other process within 1 s
without cross-process invalidation. Expiry is checked on every request
against the cached ``expires_at``, so it is exact. ``last_used_at`` is written at most once per
``key_last_used_interval_s`` per key and process, never per request.

The key's HMAC (the costliest step of a cache hit) is memoised per process for keys the database
knew: the hash is a pure function of the key and ``TERN_SECRET``, so the memo decides nothing; the
TTL cache above still decides, per request, whether the key may be used (revocation, expiry, tenant
state keep their bounds). It holds at most ``HASH_MEMO_MAX_ENTRIES`` keys (emptied when full; about
2 MB), so made-up keys, which are never stored, cannot grow it, and keeps presented keys in the
process's memory, where each request's own copy already sits while it runs.
"""

from __future__ import annotations

import hmac
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial

from sqlalchemy import or_, select, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.auth.identity import AuthenticatedKey
from gateway.errors import OpenAIError
from gateway.keys.format import hash_key, is_plausible_key
from gateway.keys.models import ApiKey
from gateway.tenants.models import Tenant
from gateway.ttl_cache import TtlCache

CACHE_MAX_ENTRIES = 10_000
HASH_MEMO_MAX_ENTRIES = 10_000


@dataclass(frozen=True, slots=True)
class _KeyState:
    """A looked-up key plus what decides whether it may be used right now."""

    key: AuthenticatedKey
    secret_hash: str
    expires_at: datetime | None
    revoked_at: datetime | None
    tenant_status: str | None
    tenant_deleted: bool


def _invalid_key() -> OpenAIError:
    return OpenAIError(401, "Invalid API key.", code="invalid_api_key")


class KeyAuthenticator:
    """One per gateway process (``GatewayState.key_authenticator``); an ``auth.identity.Authenticator``."""

    def __init__(
        self,
        *,
        sessionmaker: async_sessionmaker[AsyncSession],
        secret: bytes,
        cache_ttl_s: float,
        last_used_interval_s: float,
    ) -> None:
        self._sessionmaker = sessionmaker
        self._secret = secret
        self._last_used_interval_s = last_used_interval_s
        self._cache: TtlCache[str, _KeyState | None] = TtlCache(
            ttl_s=cache_ttl_s, max_entries=CACHE_MAX_ENTRIES
        )
        self._last_touched: dict[uuid.UUID, float] = {}
        self._hashes: dict[str, str] = {}
        """Presented key -> its ``secret_hash``, for keys the database knew (see the module doc)."""

    async def authenticate(self, token: str) -> AuthenticatedKey:
        """The key behind ``token``, or an OpenAIError: 401 unknown/revoked/expired, 403 tenant blocked."""
        secret_hash = self._hashes.get(token)
        if secret_hash is None:
            if not is_plausible_key(token):
                raise _invalid_key()
            secret_hash = hash_key(token, self._secret)
        state = await self._cache.get(secret_hash, partial(self._load, secret_hash))
        if state is None or not hmac.compare_digest(state.secret_hash, secret_hash):
            raise _invalid_key()
        if token not in self._hashes:
            if len(self._hashes) >= HASH_MEMO_MAX_ENTRIES:
                self._hashes.clear()
            self._hashes[token] = secret_hash
        now = datetime.now(UTC)
        if state.revoked_at is not None:
            raise OpenAIError(401, "This API key has been revoked.", code="key_revoked")
        if state.expires_at is not None and state.expires_at <= now:
            raise OpenAIError(
                401, f"This API key expired at {state.expires_at.isoformat()}.", code="key_expired"
            )
        if state.tenant_deleted:
            raise OpenAIError(403, "This API key's tenant has been deleted.", code="tenant_deleted")
        if state.tenant_status == "suspended":
            raise OpenAIError(403, "This API key's tenant is suspended.", code="tenant_suspended")
        await self._touch(state.key.key_id)
        return state.key

    def forget(self, secret_hash: str) -> None:
        """Drop a cached entry at once (this process only; others expire within the TTL)."""
        self._cache.forget(secret_hash)

    def forget_all(self) -> None:
        """After a tenant change, which affects all of its keys."""
        self._cache.forget()

    async def _load(self, secret_hash: str) -> _KeyState | None:
        query = (
            select(ApiKey, Tenant.status, Tenant.deleted_at)
            .outerjoin(Tenant, Tenant.id == ApiKey.tenant_id)
            .where(ApiKey.secret_hash == secret_hash)
        )
        async with self._sessionmaker() as session:
            row = (await session.execute(query)).one_or_none()
        if row is None:
            return None
        key, tenant_status, tenant_deleted_at = row
        return _KeyState(
            key=AuthenticatedKey(
                key_id=key.id,
                tenant_id=key.tenant_id,
                kind=key.kind,
                name=key.name,
                models=tuple(key.models),
                rpm_limit=key.rpm_limit,
                tpm_limit=key.tpm_limit,
                max_concurrency=key.max_concurrency,
                monthly_token_budget=key.monthly_token_budget,
            ),
            secret_hash=key.secret_hash,
            expires_at=key.expires_at,
            revoked_at=key.revoked_at,
            tenant_status=tenant_status,
            tenant_deleted=tenant_deleted_at is not None,
        )

    async def _touch(self, key_id: uuid.UUID) -> None:
        """Record use at most once per interval per process; the WHERE clause damps other processes."""
        now = time.monotonic()
        last = self._last_touched.get(key_id)
        if last is not None and now - last < self._last_used_interval_s:
            return
        self._last_touched[key_id] = now
        if len(self._last_touched) > CACHE_MAX_ENTRIES:
            self._last_touched = {key_id: now}
        used_at = datetime.now(UTC)
        cutoff = used_at - timedelta(seconds=self._last_used_interval_s)
        statement = (
            update(ApiKey)
            .where(ApiKey.id == key_id)
            .where(or_(ApiKey.last_used_at.is_(None), ApiKey.last_used_at < cutoff))
            .values(last_used_at=used_at)
        )
        async with self._sessionmaker() as session:
            await session.execute(statement)
            await session.commit()
