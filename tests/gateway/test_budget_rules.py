"""The integer money arithmetic of the hot path against the exact ``Decimal`` cost the reports bill."""

from __future__ import annotations

import random
from decimal import Decimal

from gateway.budgets.rules import PRICE_SCALE, from_nano, nano_cost, nano_str, to_nano


def test_nano_cost_is_the_decimal_cost_rounded_up() -> None:
    rng = random.Random(36)
    for _ in range(20_000):
        prompt_price, cached_price, completion_price = (
            Decimal(rng.randint(0, 10**13)) / PRICE_SCALE for _ in range(3)
        )
        prompt = rng.randint(0, 10**6)
        cached = rng.randint(0, prompt)
        completion = rng.randint(0, 10**5)
        exact = (
            (prompt - cached) * prompt_price + cached * cached_price + completion * completion_price
        ) / 10**6
        scaled = [int(p * PRICE_SCALE) for p in (prompt_price, cached_price, completion_price)]
        got = nano_cost(*scaled, prompt=prompt, cached=cached, completion=completion)
        assert got == to_nano(exact)
        assert Decimal(got) / 10**9 >= exact > Decimal(got - 1) / 10**9


def test_nano_amounts_print_as_plain_decimals() -> None:
    for nano in (0, 1, 2_000_000, 5 * 10**9, 1234567890123, 10**20 + 7):
        assert nano_str(nano) == format(from_nano(nano), "f")
