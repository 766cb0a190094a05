"""The shared async Redis client (``app.state.redis``) and its request dependency."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from redis.asyncio import Redis


def create_redis(url: str) -> Redis:
    return Redis.from_url(url, decode_responses=False, health_check_interval=30)


async def get_redis(request: Request) -> Redis:
    """``async`` so FastAPI does not run it in a worker thread."""
    return request.app.state.redis


RedisClient = Annotated[Redis, Depends(get_redis)]
