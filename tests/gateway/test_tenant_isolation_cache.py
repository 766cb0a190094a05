"""The prompt-cache oracle, closed by default: with the gateway's default settings, a tenant's answer
never reports another tenant's prompt as cached (``cached_tokens``), while its own repeats still hit.

A real engine (the default SmolLM2-135M GGUF, conftest's ``real_engines``) behind a real gateway on
real PostgreSQL and Redis, reached both ways the gateway reaches engines: Tern's RPC (the tenant is
the RPC ``cache_namespace``) and the engine's OpenAI ``/v1`` (the tenant is vLLM's ``cache_salt``).
Only one engine is configured, so every request meets the same cache and only isolation keeps the
tenants apart.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from credentials import TEST_ADMIN_KEY, TEST_SECRET
from live_server import ServerThread, create_inference_key
from real_engine import RealEngine

from gateway.app import create_app
from gateway.config import Settings

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


class Gateway:
    def __init__(self, server: ServerThread) -> None:
        self.server = server

    def tenant(self) -> str:
        """A new tenant's inference key."""
        return create_inference_key(self.server.url, TEST_ADMIN_KEY)

    def cached_tokens(self, key: str, system: str, question: str, **fields: Any) -> int:
        body = {
            "model": MODEL,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 1,
            **fields,
        }
        headers = {"Authorization": f"Bearer {key}"}
        response = httpx.post(
            f"{self.server.url}/v1/chat/completions", json=body, headers=headers, timeout=120
        )
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        assert usage["prompt_tokens"] > 200  # the shared part alone is longer than a cache block
        return int(usage["prompt_tokens_details"]["cached_tokens"])


@pytest.fixture(params=["rpc", "openai"])
def gateway(
    request: pytest.FixtureRequest, real_engines: list[RealEngine], database_url: str, redis_url: str
) -> Iterator[Gateway]:
    engine = real_engines[0]
    url = engine.url if request.param == "rpc" else f"openai+{engine.url}"
    settings = Settings(  # the defaults, but for where the parts are
        database_url=database_url,
        redis_url=redis_url,
        secret=TEST_SECRET,
        admin_key=TEST_ADMIN_KEY,
        engine_urls=[url],
        log_level="WARNING",
    )
    server = ServerThread(create_app(settings)).start()
    yield Gateway(server)
    server.stop()


def secret_system_prompt() -> str:
    """A prompt no other test sends (so only this test's requests can have cached it)."""
    marker = uuid.uuid4().hex
    return f"Confidential onboarding guide {marker}. " + " ".join(
        f"Step {i}: greet customer {marker[:8]} politely and keep answers short." for i in range(16)
    )


def test_a_tenant_never_sees_another_tenants_prompt_as_cached(gateway: Gateway) -> None:
    tenant_a, tenant_b = gateway.tenant(), gateway.tenant()
    secret = secret_system_prompt()
    gateway.cached_tokens(tenant_a, secret, "Hello?")
    # A's own repeat hits its cache: the prefix is there to be found.
    assert gateway.cached_tokens(tenant_a, secret, "Hello again?") > 0
    # B sends the same prompt: nothing of A's is reused or reported.
    assert gateway.cached_tokens(tenant_b, secret, "Hello?") == 0
    # B's second time hits B's own copy.
    assert gateway.cached_tokens(tenant_b, secret, "Hello once more?") > 0


def test_a_client_cache_salt_narrows_its_tenants_cache_and_never_reaches_another_tenants(
    gateway: Gateway,
) -> None:
    tenant_a, tenant_b = gateway.tenant(), gateway.tenant()
    secret = secret_system_prompt()
    gateway.cached_tokens(tenant_a, secret, "Hi?", cache_salt="user-1")
    assert gateway.cached_tokens(tenant_a, secret, "Hi there?", cache_salt="user-1") > 0
    # Another salt within the same tenant does not share (vLLM's meaning of the salt) ...
    assert gateway.cached_tokens(tenant_a, secret, "Hi?", cache_salt="user-2") == 0
    # ... and the same salt from another tenant reaches nothing of A's either.
    assert gateway.cached_tokens(tenant_b, secret, "Hi?", cache_salt="user-1") == 0
