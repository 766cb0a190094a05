"""The budgets domain's refusals."""

from __future__ import annotations

from gateway.exceptions import Conflict, NotFound


class BudgetNotFound(NotFound):
    def __init__(self, budget_id: int) -> None:
        super().__init__(f"Budget {budget_id} not found.", param="budget_id", code="budget_not_found")


class BudgetExists(Conflict):
    def __init__(self, metric: str, period: str) -> None:
        super().__init__(
            f"This owner already has a {period} {metric} budget; delete it first.",
            param="period",
            code="budget_exists",
        )


class KeyOfAnotherTenant(NotFound):
    def __init__(self) -> None:
        super().__init__("tenant_id has no such key_id.", param="key_id", code="key_not_found")
