"""Strict budgets under concurrency, through the gateway against real Redis and Postgres and the
stand-in engine: random budgets (several per key and per tenant, tokens and spend, every period),
random prices and random request mixes, 64 requests at a time. The stand-in counts a word a token,
fewer than the gateway's estimate, so requests that do not fit on their estimate are admitted on 0
prompt tokens and topped up to the engine's count (``test_budget_exact_prompt_e2e`` has the real
engine, whose prompts count more than their estimates).

- Gated phase: the engine holds every admitted request, so nothing settles while the 64 are admitted
  (but for requests refused at their top-up, which give back what they held). A request refused
  then must not have fit: beside what the admitted ones hold (and what those refused at their top-up
  held), some budget that applies to it has less left than it needed.
- Open phase: 64 more at once, settling while others are admitted.
- Then billed usage (the rows in Postgres, priced here) never exceeds any budget: 0 tokens and 0
  nano-units of money over.
"""

from __future__ import annotations

import asyncio
import math
import random
import string
import time
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import httpx
import pytest
from credentials import bearer
from fake_engine import REPLY, FakeEngine
from sqlalchemy import text

from gateway.wiring import gateway_state

pytestmark = [pytest.mark.anyio, pytest.mark.fake_engines(gated=True)]

CONCURRENCY = 64
ROUNDS = 2
NANO = Decimal(10) ** 9


@dataclass
class Req:
    key: int
    content: str
    max_tokens: int
    stream: bool

    @property
    def estimate(self) -> int:
        """What the gateway first reserves for the prompt: 4 bytes a token, 4 for the message."""
        return math.ceil(len(self.content.encode()) / 4) + 4

    @property
    def exact(self) -> int:
        """What the stand-in engine counts: one token a word."""
        return len(self.content.split())

    @property
    def worst_tokens(self) -> int:
        return self.exact + self.max_tokens

    def worst_nano(self, prompt_price: Decimal, completion_price: Decimal, prompt: int | None = None) -> int:
        prompt = self.exact if prompt is None else prompt
        cost = (prompt * prompt_price + self.max_tokens * completion_price) / 10**6
        return math.ceil(cost * NANO)

    def held(self, metric: str, prices: tuple[Decimal, Decimal], prompt: int) -> int:
        """What the gateway reserves for it with ``prompt`` tokens of prompt."""
        return prompt + self.max_tokens if metric == "tokens" else self.worst_nano(*prices, prompt=prompt)


@dataclass
class Budget:
    key: int | None
    """Index of the key it belongs to; None: the tenant's."""
    metric: str
    period: str
    limit: int
    """Tokens or nano-units."""
    amount: str

    def applies(self, req: Req) -> bool:
        return self.key is None or self.key == req.key


def random_request(rng: random.Random, keys: int, *, min_tokens: int = 1) -> Req:
    """``min_tokens`` 2 makes the gated engine hold the request (it pauses after the first delta,
    and a first delta that is also the last one would end the request)."""
    words = [
        "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9)))
        for _ in range(rng.randint(1, 30))
    ]
    return Req(rng.randrange(keys), " ".join(words), rng.randint(min_tokens, 10), rng.random() < 0.3)


async def send(client: httpx.AsyncClient, secret: str, req: Req) -> httpx.Response:
    body: dict[str, Any] = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": req.content}],
        "max_tokens": req.max_tokens,
        "stream": req.stream,
    }
    return await client.post("/v1/chat/completions", json=body, headers=bearer(secret))


def assert_answered(response: httpx.Response) -> bool:
    """True when served; a refusal must be a budget's (OpenAI's shape, insufficient_quota; 429 for a
    token budget, 402 for a spend budget)."""
    if response.status_code == 200:
        return True
    assert response.status_code in (402, 429), response.text
    assert ("spend budget" in response.text) == (response.status_code == 402), response.text
    assert response.json()["error"]["code"] == "insufficient_quota"
    return False


@dataclass
class Round:
    """One round's tenant, its two keys, prices and budgets."""

    tenant_id: str
    secrets: list[str]
    key_ids: list[str]
    prices: tuple[Decimal, Decimal]
    budgets: list[Budget]


async def set_random_price(
    client: httpx.AsyncClient, admin: dict[str, str], rng: random.Random, app: Any
) -> Any:
    """Random prices, with fractions of a nano-unit per token; returns (price id, prices)."""
    prices = (
        Decimal(rng.randint(10**6, 5 * 10**9)) / 10**6,
        Decimal(rng.randint(10**6, 5 * 10**9)) / 10**6,
    )
    price = {"model": "fake-model", "prompt_per_mtok": str(prices[0]), "completion_per_mtok": str(prices[1])}
    created = await client.post("/admin/prices", json=price, headers=admin)
    assert created.status_code == 201, created.text
    await gateway_state(app).request_limiter.prices.refresh(force=True)
    return created.json()["id"], prices


async def random_budgets(
    client: httpx.AsyncClient, admin: dict[str, str], rng: random.Random, rnd: Round, requests: list[Req]
) -> None:
    """0-2 budgets per owner (each key, the tenant) and metric, each a random share of what the
    requests it applies to could cost at worst."""
    for owner in (0, 1, None):
        for metric in ("tokens", "spend"):
            for period in rng.sample(["day", "week", "month", "total"], rng.randint(0, 2)):
                probe = Budget(owner, metric, period, 0, "")
                applicable = [r for r in requests if probe.applies(r)]
                if metric == "tokens":
                    limit = max(1, int(sum(r.worst_tokens for r in applicable) * rng.uniform(0.05, 0.8)))
                    amount = str(limit)
                else:
                    total = sum(r.worst_nano(*rnd.prices) for r in applicable)
                    micros = max(1, int(total * rng.uniform(0.05, 0.8)) // 1000)
                    amount = str(Decimal(micros) / 10**6)
                    limit = micros * 1000
                rnd.budgets.append(Budget(owner, metric, period, limit, amount))
                body = {"tenant_id": rnd.tenant_id, "metric": metric, "period": period, "amount": amount}
                if owner is not None:
                    body["key_id"] = rnd.key_ids[owner]
                response = await client.post("/admin/budgets", json=body, headers=admin)
                assert response.status_code == 201, response.text


def assert_refusals_were_needed(
    rnd: Round, fake_engine: FakeEngine, before: int, gated: list[Req], tasks: list[Any], seed: int
) -> list[Req]:
    """With the engine holding every admitted request: what they hold fits every budget, and each
    refused request did not fit beside it. Returns the admitted requests."""
    refused = [r for r, t in zip(gated, tasks, strict=True) if t.done()]
    admitted = [r for r, t in zip(gated, tasks, strict=True) if not t.done()]
    for req in refused:
        assert not assert_answered(tasks[gated.index(req)].result())
    prices = rnd.prices
    # Each admitted request holds its exact worst case, or more: its estimate's, unless the engine
    # had it count the prompt (it was admitted on 0 prompt tokens, then topped up to the exact count).
    topped_up = set(fake_engine.over_reserved)
    ids = {str(g.messages[0].content): g.request_id for g in fake_engine.received[before:] if g.messages}
    held_prompt = {id(r): r.exact if ids[r.content] in topped_up else r.estimate for r in admitted}
    refused_ids = {id(r): tasks[gated.index(r)].result().headers["x-request-id"] for r in refused}
    at_top_up = {id(r) for r in refused if refused_ids[id(r)] in topped_up}

    def worst(r: Req, metric: str) -> int:
        return r.worst_tokens if metric == "tokens" else r.worst_nano(*prices)

    left = {id(b): b.limit - sum(worst(r, b.metric) for r in admitted if b.applies(r)) for b in rnd.budgets}
    assert all(v >= 0 for v in left.values()), (rnd.budgets, left, seed)
    for req in refused:
        # Refused at admission: not even on 0 prompt tokens did it fit beside what was held; refused
        # at its top-up: its exact count did not. Those refused at their top-up held their
        # completion meanwhile.
        prompt = req.exact if id(req) in at_top_up else 0
        assert any(
            b.applies(req)
            and b.limit
            - sum(r.held(b.metric, prices, held_prompt[id(r)]) for r in admitted if b.applies(r))
            - sum(r.held(b.metric, prices, 0) for r in refused if id(r) in at_top_up and r is not req)
            < req.held(b.metric, prices, prompt)
            for b in rnd.budgets
        ), (req, rnd.budgets, seed)
    return admitted


async def assert_billed_within_budgets(
    app: Any, rnd: Round, served: int, served_total: int, seed: int
) -> None:
    """Billed usage, from the rows in Postgres, priced here: 0 tokens and 0 nano-units over."""
    state = gateway_state(app)
    deadline = time.monotonic() + 30
    while state.usage_recorder.flushed < served_total:
        assert time.monotonic() < deadline, "usage never reached Postgres"
        await asyncio.sleep(0.05)
    query = (
        "SELECT key_id::text AS key_id, prompt_tokens, completion_tokens FROM usage_records "
        "WHERE tenant_id = :tenant"
    )
    async with state.db_engine.connect() as conn:
        rows = (await conn.execute(text(query), {"tenant": rnd.tenant_id})).all()
    assert len(rows) == served
    prompt_price, completion_price = rnd.prices
    for b in rnd.budgets:
        mine = [r for r in rows if b.key is None or r.key_id == rnd.key_ids[b.key]]
        if b.metric == "tokens":
            billed = sum(r.prompt_tokens + r.completion_tokens for r in mine)
            assert billed <= b.limit, (b, billed, seed)
        else:
            cost = sum(
                (r.prompt_tokens * prompt_price + r.completion_tokens * completion_price) / 10**6
                for r in mine
            )
            assert cost * NANO <= b.limit, (b, cost, seed)
    assert served > 0 and all(r.completion_tokens <= len(REPLY) for r in rows)


async def test_no_overspend_and_no_needless_refusal_at_64_concurrent_requests(
    app: Any,
    client: httpx.AsyncClient,
    admin_headers: dict[str, str],
    create_tenant_and_key: Any,
    fake_engine: FakeEngine,
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    served_total = 0
    price_id = None
    for _ in range(ROUNDS):
        if price_id is not None:
            await client.delete(f"/admin/prices/{price_id}", headers=admin_headers)
        price_id, prices = await set_random_price(client, admin_headers, rng, app)
        tenant, first_secret, first_id = await create_tenant_and_key()
        second = await client.post(
            "/admin/keys",
            json={"tenant_id": tenant["id"], "name": f"{tenant['name']}-2", "kind": "inference"},
            headers=admin_headers,
        )
        rnd = Round(
            tenant["id"], [first_secret, second.json()["key"]], [first_id, second.json()["id"]], prices, []
        )
        gated = [random_request(rng, 2, min_tokens=2) for _ in range(CONCURRENCY)]
        opened = [random_request(rng, 2) for _ in range(CONCURRENCY)]
        await random_budgets(client, admin_headers, rng, rnd, gated + opened)

        # Gated: the engine holds every admitted request, nothing settles.
        assert fake_engine.gate is not None
        fake_engine.gate.clear()
        before = len(fake_engine.received)
        tasks = [asyncio.create_task(send(client, rnd.secrets[r.key], r)) for r in gated]
        deadline = time.monotonic() + 60
        while sum(t.done() for t in tasks) + len(fake_engine.received) - before < CONCURRENCY:
            assert time.monotonic() < deadline, f"requests neither refused nor admitted (seed {seed})"
            await asyncio.sleep(0.02)
        admitted = assert_refusals_were_needed(rnd, fake_engine, before, gated, tasks, seed)

        fake_engine.gate.set()
        served = sum(assert_answered(r) for r in await asyncio.gather(*tasks))
        assert served == len(admitted)
        # Open: 64 more at once, settling among admissions.
        responses = await asyncio.gather(*(send(client, rnd.secrets[r.key], r) for r in opened))
        served += sum(assert_answered(r) for r in responses)
        served_total += served
        await assert_billed_within_budgets(app, rnd, served, served_total, seed)
