"""``GET /admin/engines``: each engine's health, models, queues, KV-cache use and prefix-cache hits.

Platform admins only: engines are shared infrastructure, not any one tenant's.
"""

from __future__ import annotations

from fastapi import APIRouter

from gateway.auth.deps import AdminActor
from gateway.engines import service
from gateway.engines.schemas import EngineList
from gateway.exceptions import PlatformAdminRequired
from gateway.proxy.router import Pool

router = APIRouter(prefix="/admin/engines", tags=["admin: engines"])


@router.get("")
async def list_engines(actor: AdminActor, pool: Pool) -> EngineList:
    if not actor.is_platform:
        raise PlatformAdminRequired("see the engines")
    return EngineList(data=await service.list_engines(pool=pool))
