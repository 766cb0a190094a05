"""The Redis contract (``gateway/keyspace.py``): key names byte for byte as gateways of earlier versions
write them (a fleet mid-upgrade shares one Redis), and every Lua script's header and body against the
argument builders that call it."""

from __future__ import annotations

import inspect
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import date
from decimal import Decimal
from importlib import resources
from pathlib import Path

import pytest
from redis.asyncio import Redis

from gateway import keyspace
from gateway.budgets.rules import BudgetRule
from gateway.budgets.service import _scope_name
from gateway.limits.config import LimitsSettings
from gateway.limits.limiter import RateLimiter
from gateway.limits.liveness import Liveness
from gateway.limits.recovery import budget_key_patterns
from gateway.limits.schemas import RequestLimits, Scope
from gateway.wiring import create_limits_redis

SCRIPTS = Path(str(resources.files("gateway.limits").joinpath("scripts")))
DAY = date(2026, 11, 26)  # a Thursday: its week began on Monday the 23rd


def old_scope_keys(scope: str, period_ids: list[str]) -> list[str]:
    """The per-scope keys as the gateway has always written them (never derive these from keyspace)."""
    return [
        f"tern:rl:{scope}:req",
        f"tern:rl:{scope}:tok",
        f"tern:rl:{scope}:slots",
        f"tern:bheld:{scope}",
        f"tern:bheld:{scope}:exp",
        *(f"tern:budget:{scope}:{p}" for p in period_ids),
    ]


def every_period() -> tuple[BudgetRule, ...]:
    return tuple(
        BudgetRule.of(metric=metric, period=period, amount=10**6)  # type: ignore[arg-type]
        for period, metric in (("day", "tokens"), ("week", "spend"), ("month", "tokens"), ("total", "spend"))
    )


# --------------------------------------------------------------------------- names on the wire


def test_key_names_are_byte_for_byte_the_old_ones() -> None:
    periods = ["d20261126", "w20261123", "202611", "total"]
    for kind, model, name in (
        ("key", None, "key:K1"),
        ("tenant", None, "tenant:K1"),
        ("key_model", "m/x:1", "key:K1:model:m/x:1"),
        ("tenant_model", "m", "tenant:K1:model:m"),
    ):
        scope = Scope(kind=kind, id="K1", label="", model=model, rpm=1, budgets=every_period())  # type: ignore[arg-type]
        assert scope.name == name
        assert scope.redis_keys(DAY) == old_scope_keys(name, periods)
    tenant, key = uuid.UUID(int=1), uuid.UUID(int=2)
    assert _scope_name(tenant, None) == f"tenant:{tenant}"
    assert _scope_name(tenant, key) == f"key:{key}"
    assert budget_key_patterns(tenant_ids={"T"}, key_ids={"K"}) == [
        "tern:budget:tenant:T:*",
        "tern:budget:key:K:*",
    ]
    liveness = Liveness(None, instance_id="abc123", ttl_s=1.0)  # type: ignore[arg-type]  # no Redis call
    assert liveness.key == "tern:gw:alive:abc123" == keyspace.alive_key("abc123")
    assert keyspace.ALIVE_PREFIX == "tern:gw:alive:"
    assert (keyspace.COUNTER_FIELDS, keyspace.HELD_FIELDS) == (("tok", "spend"), ("__tok", "__spend"))


async def nothing_used(scope: Scope, start: date, end: date | None) -> tuple[int, Decimal]:
    return 0, Decimal(0)


@pytest.mark.anyio
async def test_a_request_writes_exactly_the_old_keys_and_fields(redis_url: str) -> None:
    """Admitted and settled through the real scripts: Redis then holds these keys and fields, no others."""
    owner = uuid.uuid4().hex
    budget = BudgetRule.of(metric="tokens", period="total", amount=1000)
    scope = Scope(kind="key", id=owner, label="k", rpm=10, concurrency=2, budgets=(budget,))
    client: Redis = create_limits_redis(redis_url)
    try:
        limiter = RateLimiter(redis=client, settings=LimitsSettings(), load_usage=nothing_used)
        admission = await limiter.admit(
            limits=RequestLimits(scopes=(scope,), failure_policy="closed"), reserve=5
        )
        found = {k.decode() if isinstance(k, bytes) else k for k in await client.keys(f"*{owner}*")}
        assert found == set(old_scope_keys(f"key:{owner}", ["total"])), found
        assert set(await client.hkeys(f"tern:bheld:key:{owner}")) == {b"__tok"}
        await limiter.settle(admission, tokens=3)
        assert await client.hgetall(f"tern:budget:key:{owner}:total") == {b"tok": b"3", b"spend": b"0"}
    finally:
        await client.aclose()


# --------------------------------------------------------------------------- script headers


@dataclass(frozen=True)
class Header:
    keys: list[str]
    """``KEYS[i] name`` lines, or the names of ``KEYS per scope:``."""
    per_scope_keys: bool
    argv: list[str]
    tail: tuple[int, str, list[str], list[str]] | None
    """``ARGV[i..] name:`` with its ``scope:`` and ``budget:`` field names."""


def read_header(text: str) -> Header:
    lines = []
    for line in text.splitlines():
        if not line.startswith("--"):
            break
        lines.append(line[2:].strip())
    keys: list[str] = []
    per_scope = False
    argv: list[str] = []
    tail_at, tail_name = 0, ""
    fields: dict[str, list[str]] = {"scope": [], "budget": []}
    for line in lines:
        if m := re.fullmatch(r"KEYS\[(\d+)\] (\w+)", line):
            assert int(m[1]) == len(keys) + 1, line
            keys.append(m[2])
        elif m := re.fullmatch(r"KEYS per scope: ([\w ]+), then one counter per period", line):
            keys, per_scope = m[1].split(), True
        elif m := re.fullmatch(r"ARGV\[(\d+)\] (\w+)", line):
            assert int(m[1]) == len(argv) + 1, line
            argv.append(m[2])
        elif m := re.fullmatch(r"ARGV\[(\d+)\.\.\] (\w+): .*", line):
            tail_at, tail_name = int(m[1]), m[2]
        elif tail_name and (m := re.fullmatch(r"(scope|budget): ([\w ]+)", line)):
            fields[m[1]] = m[2].split()
    tail = (tail_at, tail_name, fields["scope"], fields["budget"]) if tail_name else None
    return Header(keys, per_scope, argv, tail)


@dataclass(frozen=True)
class Call:
    argv: Callable[..., Sequence[object]]
    keys: Callable[..., Sequence[str]] | None = None
    """None: the per-scope keys (``keyspace.scope_keys``)."""
    scope_fields: tuple[str, ...] = ()


CALLS = {
    "admit.lua": Call(keyspace.admit_argv, scope_fields=keyspace.SCOPE_LIMITS),
    "topup.lua": Call(keyspace.topup_argv, scope_fields=keyspace.SCOPE_LIMITS),
    "settle.lua": Call(keyspace.settle_argv, scope_fields=keyspace.SETTLE_SCOPE_LIMITS),
    "reap.lua": Call(keyspace.reap_argv, keys=keyspace.reap_keys),
    "reap_reservations.lua": Call(keyspace.reap_argv, keys=keyspace.reap_reservations_keys),
}


def in_order(builder: Callable[..., Sequence[object]]) -> list[str]:
    """The builder's parameters, after checking that it returns them in that order."""
    names = list(inspect.signature(builder).parameters)
    assert list(builder(**{n: n for n in names})) == names, f"{builder.__name__} reorders its parameters"
    return names


def header_mismatches(header: Header, call: Call) -> list[str]:
    """How a script's header disagrees with its builders (empty: it agrees)."""
    wrong = []
    argv = in_order(call.argv)
    if header.tail is None:
        if header.argv != argv:
            wrong.append(f"ARGV {header.argv} != {argv}")
    else:
        at, name, scope_fields, budget_fields = header.tail
        if [*header.argv, name] != argv or at != len(header.argv) + 1:
            wrong.append(f"ARGV {header.argv} then [{at}..] {name} != {argv}")
        if tuple(scope_fields) != call.scope_fields or tuple(budget_fields) != keyspace.BUDGET_LIMITS:
            wrong.append(f"tail fields {scope_fields} {budget_fields}")
    if call.keys is None:
        if not header.per_scope_keys or tuple(header.keys) != keyspace.SCOPE_KEYS:
            wrong.append(f"KEYS per scope {header.keys} != {keyspace.SCOPE_KEYS}")
    elif header.per_scope_keys or header.keys != in_order(call.keys):
        wrong.append(f"KEYS {header.keys} != {in_order(call.keys)}")
    return wrong


def test_every_script_has_a_builder() -> None:
    assert sorted(p.name for p in SCRIPTS.glob("*.lua")) == sorted(CALLS)


@pytest.mark.parametrize("script", sorted(CALLS))
def test_script_header_matches_the_keyspace(script: str) -> None:
    header = read_header((SCRIPTS / script).read_text())
    assert header.argv, f"{script} has no ARGV[i] lines in its header"
    assert header_mismatches(header, CALLS[script]) == []


def test_the_header_check_catches_a_swap() -> None:
    text = (SCRIPTS / "settle.lua").read_text().replace("ARGV[2] actual_tokens", "ARGV[2] spend_nano", 1)
    text = text.replace("ARGV[3] spend_nano", "ARGV[3] actual_tokens", 1)
    assert header_mismatches(read_header(text), CALLS["settle.lua"])
    text = (SCRIPTS / "admit.lua").read_text().replace("requests tokens slots", "tokens requests slots", 1)
    assert header_mismatches(read_header(text), CALLS["admit.lua"])


def test_per_scope_keys_follow_scope_keys_order() -> None:
    """``SCOPE_KEYS`` names the keys ``scope_keys`` builds, in its order."""
    assert keyspace.scope_keys("key:K", ["p1", "p2"]) == old_scope_keys("key:K", ["p1", "p2"])
    assert keyspace.SCOPE_KEYS == ("requests", "tokens", "slots", "held", "held_exp")
    assert (*keyspace.window_keys("s"), *keyspace.reservation_keys("s")) == tuple(old_scope_keys("s", []))


def test_limit_tails_are_laid_out_as_the_headers_say() -> None:
    params = list(inspect.signature(keyspace.scope_limit_args).parameters)
    assert params[:4] == list(keyspace.SCOPE_LIMITS[:4])
    one = keyspace.scope_limit_args(rpm=1, tpm=2, concurrency=3, n_periods=4, budgets=[(5, 6, 7, 8)])
    assert one == [1, 2, 3, 4, 1, 5, 6, 7, 8]
    assert keyspace.limits_tail([one, one]) == [2, *one, *one]
    assert keyspace.settlement_tail([one]) == [1, 4, 1, 5, 6, 7, 8]


# --------------------------------------------------------------------------- script bodies


@pytest.mark.parametrize("script", sorted(CALLS))
def test_script_body_reads_the_header_layout(script: str) -> None:
    """The body's literal indices and strides agree with its header, so header and body cannot drift."""
    text = (SCRIPTS / script).read_text()
    body = "\n".join(line for line in text.splitlines() if not line.startswith("--"))
    header = read_header(text)
    argv_read = {int(i) for i in re.findall(r"ARGV\[(\d+)\]", body)}
    if header.tail is None:
        assert argv_read == set(range(1, len(header.argv) + 1))
        assert {int(i) for i in re.findall(r"KEYS\[(\d+)\]", body)} == set(range(1, len(header.keys) + 1))
        return
    at, _, scope_fields, budget_fields = header.tail
    assert max(argv_read) == at, "the tail starts with n_scopes, read at its index"
    assert re.search(rf"local argi, keyi = {at + 1}, 1\b", body)
    assert re.findall(r"argi = argi \+ (\d+)", body) == [str(len(scope_fields)), str(len(budget_fields))]
    n_keys = len(keyspace.SCOPE_KEYS)
    assert re.search(rf"keyi = keyi \+ {n_keys} \+ np\b", body)
    assert re.search(rf"local pbase = keyi \+ {n_keys - 1}\b", body)
    offsets = {int(i or 0) for i in re.findall(r"KEYS\[keyi(?: \+ (\d+))?\]", body)}
    assert offsets and max(offsets) < n_keys
