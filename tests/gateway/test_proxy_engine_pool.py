"""EnginePool against real HTTP fake engines: health, rotation, picking."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pytest
from fake_engine import FakeEngine
from live_server import free_port

from gateway.proxy.engine_pool import EnginePool, ModelNotServed, NoHealthyEngine

pytestmark = pytest.mark.anyio


@pytest.fixture
def engines() -> Iterator[list[FakeEngine]]:
    started = [FakeEngine(model=model).start() for model in ("m", "m", "other")]
    yield started
    for engine in started:
        engine.stop()


def pool_for(urls: list[str]) -> EnginePool:
    # A long interval: the tests drive probes themselves with probe_all().
    return EnginePool(urls, health_interval_s=3600, connect_timeout_s=2)


async def test_unhealthy_engine_leaves_rotation_and_comes_back(engines: list[FakeEngine]) -> None:
    pool = pool_for([e.url for e in engines])
    await pool.start()
    try:
        assert all(u.healthy for u in pool.upstreams)
        engines[0].healthy = False
        await pool.probe_all()
        assert [u.healthy for u in pool.upstreams] == [False, True, True]
        assert {pool.pick("m").url for _ in range(4)} == {engines[1].url}

        engines[0].healthy = True
        await pool.probe_all()
        assert {pool.pick("m").url for _ in range(4)} == {engines[0].url, engines[1].url}
    finally:
        await pool.close()


async def test_pick_prefers_least_inflight_and_filters_by_model(engines: list[FakeEngine]) -> None:
    pool = pool_for([e.url for e in engines])
    await pool.start()
    try:
        first, second, other = pool.upstreams
        first.inflight = 3
        assert {pool.pick("m").url for _ in range(4)} == {second.url}
        assert pool.pick("other") is other
        with pytest.raises(ModelNotServed):
            pool.pick("missing")
        assert sorted(m.id for m in pool.models()) == ["m", "other"]
    finally:
        await pool.close()


async def test_unreachable_engines_mean_not_ready() -> None:
    pool = pool_for([f"http://127.0.0.1:{free_port()}"])
    await pool.start()
    try:
        assert not await pool.any_healthy()
        assert pool.upstreams[0].last_error
        assert pool.models() == []
        with pytest.raises(NoHealthyEngine):
            pool.pick("m")
    finally:
        await pool.close()


async def test_background_prober_restores_an_engine() -> None:
    engine = FakeEngine(model="m", healthy=False).start()
    pool = EnginePool([engine.url], health_interval_s=0.05, connect_timeout_s=2)
    await pool.start()
    try:
        assert not await pool.any_healthy()
        engine.healthy = True
        checks = engine.health_checks
        with anyio.fail_after(10):
            # Two probe rounds after the flip it must be back. The counter lives in the
            # engine's server thread, so there is no event to await.
            while engine.health_checks < checks + 2:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        assert await pool.any_healthy()
    finally:
        await pool.close()
        engine.stop()
