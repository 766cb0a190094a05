"""Strict budgets and TPM limits whatever the prompt, through the gateway in front of the real engine
(the default SmolLM2 GGUF), on real PostgreSQL and Redis: 64 concurrent requests whose prompts
tokenize far from 4 bytes a token (``prompt_mix``), random token and spend budgets, random prices.

- 0 overspend, in tokens and in nano-units, from the usage rows in Postgres;
- every refusal is billed nothing (no usage row), and every answer is billed its exact prompt;
- no request is refused while its exact worst case fits: once the 64 have settled, every refused
  request is sent again, one at a time, and must be admitted exactly when its exact worst case
  fits what every budget has left (the test keeps that count from what it was billed);
- the same scenario against the engine's own OpenAI ``/v1`` (an ``openai``-kind upstream, which
  counts nothing for the gateway): 0 overspend;
- a key allowed 2,000 tokens a minute never has more admitted in a minute, and a request is told
  it can never fit (400) only when its exact worst case is over the limit.
"""

from __future__ import annotations

import asyncio
import random
import time
from datetime import timedelta
from decimal import Decimal
from typing import Any

import httpx
import pytest
from credentials import bearer
from prompt_mix import Req, cost_nano
from real_engine import RealEngine
from sqlalchemy import text

from gateway.wiring import gateway_state

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

CONCURRENCY = 64
TPM = 2000


@pytest.fixture
def engine_urls(request: pytest.FixtureRequest, real_engines: list[RealEngine]) -> list[str]:
    """The real engine over its RPC, or (``openai`` in the test's name) over its own ``/v1``."""
    url = real_engines[0].url
    return [f"openai+{url}" if "openai" in request.node.name else url]


class Budget:
    def __init__(self, key: int | None, metric: str, limit: int) -> None:
        self.key, self.metric, self.limit = key, metric, limit
        self.used = 0

    def applies(self, req: Req) -> bool:
        return self.key is None or self.key == req.key

    def need(self, req: Req, prices: tuple[Decimal, Decimal]) -> int:
        return req.worst_tokens if self.metric == "tokens" else req.worst_nano(prices)


async def send(client: httpx.AsyncClient, secret: str, req: Req) -> httpx.Response:
    return await client.post("/v1/chat/completions", json=req.body, headers=bearer(secret), timeout=300)


def refused_for_budget(response: httpx.Response) -> bool:
    """True for a budget's refusal (OpenAI's shape, 429 tokens / 402 spend), False when served."""
    if response.status_code == 200:
        return False
    assert response.status_code in (402, 429), response.text
    assert response.json()["error"]["code"] == "insufficient_quota", response.text
    return True


async def setup_budgets(
    app: Any,
    client: httpx.AsyncClient,
    admin: dict[str, str],
    create: Any,
    rng: random.Random,
    reqs: list[Req],
) -> tuple[list[str], list[str], list[Budget], tuple[Decimal, Decimal], str]:
    prices = (Decimal(rng.randint(10**6, 5 * 10**9)) / 10**6, Decimal(rng.randint(10**6, 5 * 10**9)) / 10**6)
    body = {"model": reqs[0].body["model"], "prompt_per_mtok": str(prices[0])}
    created = await client.post(
        "/admin/prices", json=body | {"completion_per_mtok": str(prices[1])}, headers=admin
    )
    assert created.status_code == 201, created.text
    tenant, first_secret, first_id = await create()
    second = await client.post(
        "/admin/keys",
        json={"tenant_id": tenant["id"], "name": f"{tenant['name']}-2", "kind": "inference"},
        headers=admin,
    )
    secrets, key_ids = [first_secret, second.json()["key"]], [first_id, second.json()["id"]]
    budgets: list[Budget] = []
    for owner in (0, 1, None):
        for metric in rng.sample(["tokens", "spend"], rng.randint(1, 2)):
            probe = Budget(owner, metric, 0)
            total = sum(probe.need(r, prices) for r in reqs if probe.applies(r))
            limit = max(1, int(total * rng.uniform(0.05, 0.7)))
            if metric == "spend":
                limit = max(1, limit // 1000) * 1000  # whole micro-units: the admin API's precision
            amount = str(limit) if metric == "tokens" else str(Decimal(limit) / 10**9)
            budgets.append(Budget(owner, metric, limit))
            body = {
                "tenant_id": tenant["id"],
                "metric": metric,
                "period": rng.choice(["day", "month", "total"]),
            }
            if owner is not None:
                body["key_id"] = key_ids[owner]
            response = await client.post("/admin/budgets", json=body | {"amount": amount}, headers=admin)
            assert response.status_code == 201, response.text
    await gateway_state(app).request_limiter.prices.refresh(force=True)
    return secrets, key_ids, budgets, prices, tenant["id"]


async def billed_rows(app: Any, tenant_id: str, served: int) -> dict[str, Any]:
    """The tenant's usage rows by request id, once ``served`` of them reached Postgres."""
    state = gateway_state(app)
    deadline = time.monotonic() + 60
    while True:
        async with state.db_engine.connect() as conn:
            rows = (
                await conn.execute(
                    text(
                        "SELECT request_id, key_id::text AS key_id, prompt_tokens, completion_tokens, "
                        "started_at FROM usage_records WHERE tenant_id = :tenant"
                    ),
                    {"tenant": tenant_id},
                )
            ).all()
        if len(rows) >= served or time.monotonic() > deadline:
            return {r.request_id: r for r in rows}
        await asyncio.sleep(0.1)


def assert_no_overspend(
    budgets: list[Budget],
    rows: dict[str, Any],
    key_ids: list[str],
    prices: tuple[Decimal, Decimal],
    seed: int,
) -> None:
    for b in budgets:
        mine = [r for r in rows.values() if b.key is None or r.key_id == key_ids[b.key]]
        if b.metric == "tokens":
            b.used = sum(r.prompt_tokens + r.completion_tokens for r in mine)
        else:
            b.used = sum(cost_nano(prices, r.prompt_tokens, r.completion_tokens) for r in mine)
        assert b.used <= b.limit, (b.key, b.metric, b.limit, b.used, seed)


async def concurrent_round(
    app: Any, client: httpx.AsyncClient, admin: dict[str, str], create: Any, *, stream: bool
) -> tuple[int, list[Req], list[Budget], tuple[Decimal, Decimal], list[str], list[str], dict[str, Any]]:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    reqs = [Req.draw(rng, i, 2, stream=stream) for i in range(CONCURRENCY)]
    secrets, key_ids, budgets, prices, tenant_id = await setup_budgets(app, client, admin, create, rng, reqs)
    responses = await asyncio.gather(*(send(client, secrets[r.key], r) for r in reqs))
    refused = [r for r, resp in zip(reqs, responses, strict=True) if refused_for_budget(resp)]
    served = {
        resp.headers["x-request-id"]: r for r, resp in zip(reqs, responses, strict=True) if r not in refused
    }
    rows = await billed_rows(app, tenant_id, len(served))
    # Billed exactly the answers, each its exact prompt and completion; refusals billed nothing.
    assert set(rows) == set(served), seed
    for request_id, req in served.items():
        assert (rows[request_id].prompt_tokens, rows[request_id].completion_tokens) == (
            req.prompt,
            req.completion,
        ), (req.body, seed)
    assert_no_overspend(budgets, rows, key_ids, prices, seed)
    return seed, refused, budgets, prices, secrets, key_ids, rows


async def test_no_overspend_and_no_refusal_that_fits_whatever_the_prompt(
    app: Any, client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key: Any
) -> None:
    seed, refused, budgets, prices, secrets, _, _ = await concurrent_round(
        app, client, admin_headers, create_tenant_and_key, stream=True
    )
    # Nothing in flight: each refused request, again, is admitted exactly when its exact worst case fits.
    for req in refused:
        req.body["stream"] = False
        req.body.pop("stream_options", None)
        mine = [b for b in budgets if b.applies(req)]
        fits = all(b.used + b.need(req, prices) <= b.limit for b in mine)
        response = await send(client, secrets[req.key], req)
        assert refused_for_budget(response) != fits, (req.body, req.prompt, fits, seed)
        if fits:
            usage = response.json()["usage"]
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (req.prompt, req.completion)
            own = [
                b.limit - b.used - b.need(req, prices)
                for b in mine
                if b.key is not None and b.metric == "tokens"
            ]
            if own:  # what the key's tightest token budget has left, its exact worst case held
                assert 0 <= int(response.headers["x-tern-budget-remaining-tokens"]) <= min(own), seed
            for b in mine:
                b.used += b.need(req, prices)


async def test_openai_upstream_no_overspend(
    app: Any, client: httpx.AsyncClient, admin_headers: dict[str, str], create_tenant_and_key: Any
) -> None:
    """The engine's own /v1, an ``openai``-kind upstream: reserved at the bound (bytes + template)."""
    await concurrent_round(app, client, admin_headers, create_tenant_and_key, stream=False)


async def test_tpm_never_admits_more_than_the_limit_in_a_minute(
    app: Any, client: httpx.AsyncClient, create_tenant_and_key: Any
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    reqs = [Req.draw(rng, i, 1) for i in range(CONCURRENCY)]
    tenant, secret, _ = await create_tenant_and_key(tpm_limit=TPM)
    responses = await asyncio.gather(*(send(client, secret, r) for r in reqs))
    served = {}
    for req, response in zip(reqs, responses, strict=True):
        if response.status_code == 200:
            served[response.headers["x-request-id"]] = req
        elif req.worst_tokens > TPM:  # it can never fit: told so, not to retry
            assert response.status_code == 400, (response.text, req.worst_tokens, seed)
            assert response.json()["error"]["code"] == "tokens_exceed_rate_limit"
        else:
            assert response.status_code == 429, (response.text, req.worst_tokens, seed)
            assert response.json()["error"]["code"] == "rate_limit_exceeded"
    assert served, seed
    rows = await billed_rows(app, tenant["id"], len(served))
    assert set(rows) == set(served), seed
    starts = sorted((r.started_at, r.prompt_tokens + r.completion_tokens) for r in rows.values())
    for at, _ in starts:  # every minute-long window starting at an admission
        admitted = sum(tokens for t, tokens in starts if at <= t < at + timedelta(seconds=60))
        assert admitted <= TPM, (admitted, seed)
