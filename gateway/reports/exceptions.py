"""The reports domain's refusals (prices)."""

from __future__ import annotations

from datetime import date

from gateway.exceptions import Conflict, NotFound


class PriceNotFound(NotFound):
    def __init__(self, price_id: int) -> None:
        super().__init__(f"Price {price_id} not found.", param="price_id", code="price_not_found")


class PriceExists(Conflict):
    def __init__(self, model: str, effective_from: date) -> None:
        super().__init__(
            f"A price for {model!r} taking effect on {effective_from} already exists; "
            "delete it first or pick another effective_from.",
            param="effective_from",
            code="price_exists",
        )
