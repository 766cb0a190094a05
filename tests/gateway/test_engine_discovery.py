"""Engines found by DNS (``dns+`` in TERN_ENGINE_URLS): the pool follows the headless Service's
addresses as engines come and go, and the engine-only routes stay off the tenant API.

The resolver is the test's (a list it changes); the engines are real HTTP fake engines on distinct
loopback addresses (127.0.0.2, .3, ...) sharing one port, as pods behind one Service do.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator

import anyio
import httpx
import pytest
from credentials import CreateTenantAndKey, bearer
from fake_engine import FakeEngine
from live_server import ServerThread, free_port

from gateway.config import EngineSpec, Settings, parse_engine_url
from gateway.proxy.engine_discovery import EngineDiscovery, at_address
from gateway.proxy.engine_pool import EnginePool

pytestmark = pytest.mark.anyio

ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")


class ListResolver:
    """Answers with whatever the test last put in ``addresses``; ``fail`` makes lookups fail."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.fail = False
        self.lookups: list[str] = []

    async def __call__(self, host: str) -> list[str]:
        self.lookups.append(host)
        if self.fail:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return list(self.addresses)


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def pods(port: int) -> Iterator[dict[str, FakeEngine]]:
    """One fake engine per loopback address, all on ``port``."""
    started: dict[str, FakeEngine] = {}
    for address in ADDRESSES:
        engine = FakeEngine(port=port)
        engine._server = ServerThread(engine.app, port=port, lifespan="off", host=address).start()
        started[address] = engine
    yield started
    for engine in started.values():
        engine.stop()


def test_dns_entries_parse_with_and_without_a_kind() -> None:
    assert parse_engine_url("dns+http://e.ns.svc:8100") == EngineSpec("tern", "http://e.ns.svc:8100", True)
    assert parse_engine_url("tern+dns+http://e:8100/") == EngineSpec("tern", "http://e:8100", True)
    assert parse_engine_url("openai+dns+https://v:8000") == EngineSpec("openai", "https://v:8000", True)
    assert parse_engine_url("http://e:8100") == EngineSpec("tern", "http://e:8100", False)
    settings = Settings(engine_urls="dns+http://e.ns.svc:8100,openai+http://v:8000")
    assert [s.discover for s in settings.engine_specs()] == [True, False]
    with pytest.raises(ValueError, match="dns"):
        Settings(engine_urls="dns+ftp://e:8100")


def test_an_address_replaces_the_host_only() -> None:
    spec = EngineSpec("openai", "http://vllm.ns.svc:8000/base", True)
    assert at_address(spec, "10.0.0.7") == EngineSpec("openai", "http://10.0.0.7:8000/base", False)
    assert at_address(spec, "fd00::7").url == "http://[fd00::7]:8000/base"


async def test_a_failed_lookup_keeps_the_last_answer() -> None:
    resolver = ListResolver(["10.0.0.1", "10.0.0.2"])
    discovery = EngineDiscovery(
        [parse_engine_url("dns+http://e:8100"), parse_engine_url("http://s:1")], resolver
    )
    first = [s.url for s in await discovery.engines()]
    assert first == ["http://10.0.0.1:8100", "http://10.0.0.2:8100", "http://s:1"]
    resolver.fail = True
    assert [s.url for s in await discovery.engines()] == first
    resolver.fail, resolver.addresses = False, []
    assert [s.url for s in await discovery.engines()] == ["http://s:1"]  # an answer of none is an answer
    assert resolver.lookups == ["e", "e", "e"]


async def test_pool_follows_the_services_addresses(pods: dict[str, FakeEngine], port: int) -> None:
    resolver = ListResolver([ADDRESSES[0]])
    pool = EnginePool([f"dns+http://tern-engine.tern.svc:{port}"], health_interval_s=3600, resolver=resolver)
    await pool.start()
    try:
        assert [(u.url, u.healthy) for u in pool.upstreams] == [(f"http://{ADDRESSES[0]}:{port}", True)]

        resolver.addresses = list(ADDRESSES)  # scaled up to three
        await pool.rediscover()
        assert sorted(u.url for u in pool.upstreams) == [f"http://{a}:{port}" for a in ADDRESSES]
        assert all(u.healthy for u in pool.upstreams)
        assert {pool.pick("fake-model").url for _ in range(6)} == {u.url for u in pool.upstreams}

        gone = next(u for u in pool.upstreams if u.url == f"http://{ADDRESSES[0]}:{port}")
        gone.inflight = 1  # a request still streams from the pod that goes away
        resolver.addresses = list(ADDRESSES[1:])  # scaled down to two
        await pool.rediscover()
        assert sorted(u.url for u in pool.upstreams) == [f"http://{a}:{port}" for a in ADDRESSES[1:]]
        assert gone not in pool.upstreams and not gone.healthy and not gone.session.closed
        gone.inflight = 0
        await pool.rediscover()
        assert gone.session.closed  # closed once its last request ended
    finally:
        await pool.close()


async def test_the_health_loop_follows_without_being_asked(pods: dict[str, FakeEngine], port: int) -> None:
    resolver = ListResolver([ADDRESSES[0]])
    pool = EnginePool([f"dns+http://tern-engine.tern.svc:{port}"], health_interval_s=0.05, resolver=resolver)
    await pool.start()
    try:
        resolver.addresses = list(ADDRESSES[:2])
        with anyio.fail_after(30):
            while sum(u.healthy for u in pool.upstreams) < 2:  # noqa: ASYNC110  (the pool's own loop acts)
                await anyio.sleep(0.02)
        resolver.addresses = [ADDRESSES[1]]
        with anyio.fail_after(30):
            while len(pool.upstreams) != 1:  # noqa: ASYNC110
                await anyio.sleep(0.02)
        assert pool.upstreams[0].url == f"http://{ADDRESSES[1]}:{port}"
    finally:
        await pool.close()


@pytest.mark.fake_engines(count=1)
async def test_render_routes_are_not_forwarded_to_engines(
    client: httpx.AsyncClient, create_tenant_and_key: CreateTenantAndKey, fake_engine: FakeEngine
) -> None:
    """An engine's /v1/(chat/)completions/render serve the cluster's router only: a tenant's key
    reaches no such route through the gateway, and the engine sees nothing."""
    _, secret, _ = await create_tenant_and_key()
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    for path, body in (
        ("/v1/chat/completions/render", chat),
        ("/v1/completions/render", {"model": "fake-model", "prompt": "hi"}),
    ):
        response = await client.post(path, json=body, headers=bearer(secret))
        assert response.status_code in (404, 405), response.text
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert fake_engine.received == []
    # The gateway itself still serves chat for that key: the refusal is the route, not the key.
    ok = await client.post("/v1/chat/completions", json=chat, headers=bearer(secret))
    assert ok.status_code == 200, ok.text
    assert len(fake_engine.received) == 1
