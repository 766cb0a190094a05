"""The shared async Redis client (``GatewayState.redis``): readiness checks and the key cache's peers."""

from __future__ import annotations

from redis.asyncio import Redis


def create_redis(url: str) -> Redis:
    return Redis.from_url(url, decode_responses=False, health_check_interval=30)
