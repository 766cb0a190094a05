"""Fault test: the gateway process is SIGKILLed under load, 5 times, and started again (issue 35).

A real ``tern gateway`` on real PostgreSQL and Redis, in front of Tern's real engine (the default
model), once over the RPC and once as an ``openai``-kind upstream (the engine's own ``/v1``). 32
clients loop streaming and non-streaming requests through the kills; once the database is paused
(SIGSTOP) while the gateway is killed; at the last kill a key with ``max_concurrency`` 4 has 4
streams in flight. Then:

- every request a client saw complete is billed exactly once, for what it was told (the journal);
- every stream the kill cut is billed between what its client received and what the engine could
  generate (the engine's ledger), or, behind an ``openai``-kind upstream, from the journal's last
  snapshot and marked estimated;
- no request id has two rows and the rollups equal the rows, through every replay;
- the ``max_concurrency`` key is admitted again as soon as the gateway is back, not after its slot
  TTL; and the key's monthly budget counter equals its billed rows.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from credentials import TEST_ADMIN_KEY, TEST_SECRET
from gateway_crash import Attempt, GatewayProcess, Load, postgres_paused
from real_engine import RealEngine
from test_usage_e2e import read_usage

from gateway import keyspace
from gateway.budgets.periods import period_id
from tern_stack.services import PostgresServer

pytestmark = pytest.mark.slow

CLIENTS = 32
KILLS = 5
PAUSED_KILL = 2
LIMITED_KILL = KILLS - 1
BILLING_DEADLINE_S = 60.0


def make_key(url: str, **limits: Any) -> tuple[str, str]:
    """A new tenant and inference key (secret, id) through the admin API."""
    admin = {"Authorization": f"Bearer {TEST_ADMIN_KEY}"}
    with httpx.Client(base_url=url, timeout=30, headers=admin) as client:
        tenant = client.post("/admin/tenants", json={"name": f"crash-{time.monotonic_ns()}"}).json()
        body = {"tenant_id": tenant["id"], "name": "key", "kind": "inference", **limits}
        created = client.post("/admin/keys", json=body)
        assert created.status_code == 201, created.text
        return created.json()["key"], created.json()["id"]


def hold_limited_streams(load: Load) -> list[threading.Thread]:
    """4 streams on the max_concurrency-4 key, each with a token received (so each holds a slot)."""
    before = len(load.attempts)
    threads = [
        threading.Thread(target=load.one, args=("limited",), kwargs={"stream": True, "max_tokens": 60})
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 120
    while True:
        held = [a for a in load.attempts[before:] if a.key_name == "limited"]
        if len(held) == 4 and all(a.tokens > 0 for a in held):
            return threads
        assert not any(a.status not in (None, 200) for a in held), held
        assert time.monotonic() < deadline, "the limited streams got no tokens"
        time.sleep(0.05)


def run_with_kills(
    engine_spec: str, database_url: str, redis_url: str, postgres: PostgresServer, tmp_path: Path
) -> tuple[Load, dict[str, str], GatewayProcess]:
    env = {
        **os.environ,
        "TERN_DATABASE_URL": database_url,
        "TERN_REDIS_URL": redis_url,
        "TERN_SECRET": TEST_SECRET,
        "TERN_ADMIN_KEY": TEST_ADMIN_KEY,
        "TERN_ENGINE_URLS": engine_spec,
        "TERN_ENGINE_HEALTH_INTERVAL_S": "0.25",
        "TERN_LOG_LEVEL": "WARNING",
        "TERN_USAGE_SPOOL_DIR": str(tmp_path / "spool"),
    }
    gateway = GatewayProcess(env, tmp_path / "gateway.log").start()
    main_key, main_id = make_key(gateway.url, monthly_token_budget=10**9)
    limited_key, limited_id = make_key(gateway.url, max_concurrency=4)
    auth = {"Authorization": f"Bearer {main_key}"}
    model = httpx.get(f"{gateway.url}/v1/models", headers=auth).json()["data"][0]["id"]
    load = Load(gateway.url, model, {"main": main_key, "limited": limited_key})
    load.up.set()
    load.start(CLIENTS, key_name="main")
    rng = random.Random(35)
    t0 = time.monotonic()

    def phase(what: str) -> None:
        print(f"[{time.monotonic() - t0:7.1f}] {what} attempts={len(load.attempts)}", flush=True)

    try:
        for kill in range(KILLS):
            phase(f"kill {kill}")
            time.sleep(rng.uniform(1.0, 3.0))
            if kill == PAUSED_KILL:
                with postgres_paused(postgres):
                    time.sleep(1.0)  # answers complete meanwhile: only the journal has them
                    load.up.clear()
                    gateway.kill()
            elif kill == LIMITED_KILL:
                held = hold_limited_streams(load)
                load.up.clear()
                gateway.kill()
                for thread in held:
                    thread.join(60)
            else:
                load.up.clear()
                gateway.kill()
            phase("killed")
            gateway.start()
            load.up.set()
            phase("started")
            if kill == LIMITED_KILL:  # the dead process's 4 slots do not lock the key out
                again = load.one("limited", stream=False, max_tokens=2)
                assert again.status == 200, again
        time.sleep(1.0)
    except BaseException:
        gateway.stop()
        raise
    finally:
        phase("finishing")
        load.finish()
        phase("finished")
    return load, {"main": main_id, "limited": limited_id}, gateway


def wait_until_billed(
    database_url: str, request_ids: set[str], attempts: tuple[Attempt, ...] | list[Attempt] = ()
) -> list[dict[str, Any]]:
    deadline = time.monotonic() + BILLING_DEADLINE_S
    while True:
        rows = read_usage(database_url)
        missing = request_ids - {r["request_id"] for r in rows}
        if not missing:
            return rows
        unbilled = [a for a in attempts if a.request_id in missing][:5]
        assert time.monotonic() < deadline, f"{len(missing)} requests never billed: {unbilled or missing}"
        time.sleep(0.5)


def check_billing(
    attempts: list[Attempt], database_url: str, *, estimated_cuts: bool
) -> tuple[dict[str, dict[str, Any]], int]:
    completed = [a for a in attempts if a.completed]
    cut = [a for a in attempts if a.stream and a.status == 200 and not a.completed]
    assert len(completed) > 50 and cut, (len(completed), len(cut))
    expected = {a.request_id for a in completed} | {a.request_id for a in cut if a.tokens >= 3}
    rows = wait_until_billed(database_url, {rid for rid in expected if rid is not None}, attempts)
    counts = Counter(r["request_id"] for r in rows)
    assert max(counts.values()) == 1, "a request was billed twice"
    by_id = {r["request_id"]: r for r in rows}
    for a in completed:  # exact: what the client was told
        row = by_id[a.request_id]
        assert row["completion_tokens"] == a.reported_completion_tokens == a.tokens, (a, row)
        assert row["status"] == 200 and not row["usage_estimated"], (a, row)
    estimated = 0
    for a in cut:
        row = by_id.get(a.request_id)
        if row is None:
            assert estimated_cuts and a.tokens < 3, a  # only a snapshot-less openai stream goes unbilled
            continue
        if row["usage_estimated"]:  # what the journal last saw (sent to the client, or about to be)
            assert estimated_cuts and 1 <= row["completion_tokens"] <= a.tokens + 1, (a, row)
            estimated += 1
        else:  # what the engine generated: at least what the client received, at most max_tokens
            assert a.tokens <= row["completion_tokens"] <= a.max_tokens, (a, row)
    return by_id, estimated


def budget_counter_equals_rows(load: Load, redis_url: str, database_url: str, key_id: str) -> None:
    """After the recoveries dropped it, the key's monthly counter is seeded again from the rows by the
    next admission, and from then on counts exactly what is billed."""
    month = period_id("month", datetime.now(UTC).date())
    counter = keyspace.counter_key(keyspace.scope_name("key", key_id), month)
    client = redis.Redis.from_url(redis_url)
    try:
        for _ in range(10):  # a recovery may still drop the counter once more meanwhile
            final = load.one("main", stream=False, max_tokens=2)
            assert final.status == 200 and final.request_id is not None, final
            rows = wait_until_billed(database_url, {final.request_id})
            billed = sum(
                r["prompt_tokens"] + r["completion_tokens"] for r in rows if str(r["key_id"]) == key_id
            )
            counted = client.hget(counter, "tok")
            if counted is not None:
                assert int(counted) == billed, (counted, billed)
                return
            time.sleep(0.5)
        raise AssertionError("the budget counter was never seeded again")
    finally:
        client.close()


def test_gateway_sigkilled_under_load_bills_exactly_once(
    real_engines: list[RealEngine],
    database_url: str,
    redis_url: str,
    postgres_server: PostgresServer,
    tmp_path: Path,
) -> None:
    load, key_ids, gateway = run_with_kills(
        real_engines[0].url, database_url, redis_url, postgres_server, tmp_path
    )
    try:
        check_billing(load.attempts, database_url, estimated_cuts=False)
        budget_counter_equals_rows(load, redis_url, database_url, key_ids["main"])
    finally:
        gateway.stop()


def test_gateway_sigkilled_in_front_of_an_openai_engine_estimates_cut_streams(
    real_engines: list[RealEngine],
    database_url: str,
    redis_url: str,
    postgres_server: PostgresServer,
    tmp_path: Path,
) -> None:
    load, _, gateway = run_with_kills(
        f"openai+{real_engines[1].url}", database_url, redis_url, postgres_server, tmp_path
    )
    gateway.stop()
    _, estimated = check_billing(load.attempts, database_url, estimated_cuts=True)
    assert estimated > 0, "no cut stream was billed from the journal's snapshots"
