"""Cache-aware routing with two real engines (the default SmolLM2-135M GGUF, one thread each)
behind a real gateway: requests sharing a prefix land on the engine that served it, and the
engine confirms the hit (``cached_tokens``); with ``TERN_PREFIX_CACHE_ISOLATION=tenant`` (the default)
a tenant is never routed on another tenant's prefix."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import pytest
from credentials import TEST_ADMIN_KEY, TEST_SECRET
from live_server import ServerThread, create_inference_key
from real_engine import RealEngine

from gateway.app import create_app
from gateway.config import Settings
from gateway.proxy.outcome import RelayOutcome
from gateway.wiring import gateway_state

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


def system_prompt(topic: str) -> str:
    return " ".join(f"Rule {i} about {topic}: answer briefly and politely." for i in range(16))


@pytest.fixture(scope="module")
def engines(real_engines: list[RealEngine]) -> list[RealEngine]:
    return real_engines


class RoutedGateway:
    """A live gateway that records which engine served each request and what it reported."""

    def __init__(self, settings: Settings) -> None:
        self.server = ServerThread(create_app(settings)).start()
        self.outcomes: dict[str, RelayOutcome] = {}
        self.arrived = threading.Condition()
        gateway_state(self.server.server.config.app).completion_hooks.append(self._record)

    async def _record(self, outcome: RelayOutcome) -> None:
        with self.arrived:
            self.outcomes[outcome.request_id] = outcome
            self.arrived.notify_all()

    def key(self) -> str:
        return create_inference_key(self.server.url, TEST_ADMIN_KEY)

    def ask(self, key: str, system: str, question: str) -> RelayOutcome:
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 1,
        }
        resp = httpx.post(
            f"{self.server.url}/v1/chat/completions",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=120,
        )
        assert resp.status_code == 200, resp.text
        request_id = resp.headers["x-request-id"]
        with self.arrived:  # the hooks run once the answer is sent
            assert self.arrived.wait_for(lambda: request_id in self.outcomes, timeout=30)
            return self.outcomes[request_id]


def routed_gateway(
    engines: list[RealEngine], database_url: str, redis_url: str, **settings: Any
) -> RoutedGateway:
    return RoutedGateway(
        Settings(
            database_url=database_url,
            redis_url=redis_url,
            secret=TEST_SECRET,
            admin_key=TEST_ADMIN_KEY,
            engine_urls=[e.url for e in engines],
            log_level="WARNING",
            **settings,
        )
    )


def test_requests_sharing_a_prefix_land_on_the_engine_that_served_it(
    engines: list[RealEngine], database_url: str, redis_url: str
) -> None:
    gw = routed_gateway(engines, database_url, redis_url, prefix_cache_isolation="shared")
    try:
        key, other_tenant = gw.key(), gw.key()
        sports, cooking = system_prompt("sports"), system_prompt("cooking")
        first_sports = gw.ask(key, sports, "Who won?")
        first_cooking = gw.ask(key, cooking, "What is for dinner?")
        # A new prefix goes to the engine that holds fewer: the two prefixes now live apart.
        assert {first_sports.engine_url, first_cooking.engine_url} == {e.url for e in engines}
        for i in range(2):
            again = gw.ask(key, sports, f"And the score in game {i}?")
            assert again.engine_url == first_sports.engine_url and again.cached_tokens > 0
            again = gw.ask(key, cooking, f"And dessert number {i}?")
            assert again.engine_url == first_cooking.engine_url and again.cached_tokens > 0
        # A shared prefix cache (one organisation's choice): another tenant's request reuses it too.
        theirs = gw.ask(other_tenant, sports, "Who lost?")
        assert theirs.engine_url == first_sports.engine_url and theirs.cached_tokens > 0
    finally:
        gw.server.stop()


def test_a_tenant_isolated_deployment_never_routes_on_another_tenants_prefix(
    engines: list[RealEngine], database_url: str, redis_url: str
) -> None:
    gw = routed_gateway(engines, database_url, redis_url)  # the default isolation
    try:
        tenant_a, tenant_b = gw.key(), gw.key()
        weather = system_prompt("weather")
        mine = gw.ask(tenant_a, weather, "Will it rain?")
        theirs = gw.ask(tenant_b, weather, "Will it snow?")
        # B's identical prefix is not A's: it goes where no one's prefix is, and hits no cache.
        assert theirs.engine_url != mine.engine_url and theirs.cached_tokens == 0
        # Each tenant's own follow-ups stick to its own engine.
        assert gw.ask(tenant_a, weather, "Will it be windy?").engine_url == mine.engine_url
        assert gw.ask(tenant_b, weather, "Will it be sunny?").engine_url == theirs.engine_url
    finally:
        gw.server.stop()
