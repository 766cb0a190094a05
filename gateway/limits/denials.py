"""A refused admission as the client sees it: OpenAI's error shape, a status, a message that says
which limit or budget refused the request and when it frees up, and ``retry-after``."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.budgets.periods import resets_at
from gateway.budgets.rules import BudgetRule, from_nano
from gateway.errors import OpenAIError
from gateway.limits.config import LimitsSettings
from gateway.limits.schemas import Admission, Scope, WindowState, rate_limit_headers, retry_after_seconds
from gateway.metrics import limit_refusals_by


class TokensRefused(OpenAIError):
    """A refusal for the tokens the request reserves (a tpm limit, a budget), not for its count of
    requests: one that reserved an estimate of its prompt is looked at again with its exact count."""


@dataclass(slots=True)
class Denial:
    scope: Scope
    reason: str
    retry_after_ms: int
    budget: BudgetRule | None = None
    """The budget that refused (``token_budget`` / ``spend_budget``)."""


def raise_denial(denial: Denial, admission: Admission, settings: LimitsSettings) -> None:
    limit_refusals_by(denial.reason).inc()
    scope, reserve = denial.scope, admission.reserved_tokens
    retry = retry_after_seconds(denial.retry_after_ms)
    if denial.reason in ("rpm", "tpm"):
        exhausted = WindowState(
            (scope.rpm if denial.reason == "rpm" else scope.tpm) or 0, 0, denial.retry_after_ms
        )
        if denial.reason == "rpm":
            headers = rate_limit_headers(exhausted, None)
            what = f"{scope.rpm} requests per minute"
        else:
            headers = rate_limit_headers(None, exhausted)
            what = (
                f"{scope.tpm} tokens per minute; this request reserves {reserve} tokens "
                "(prompt plus max_tokens)"
            )
        message = f"Rate limit reached for {scope.label}: {what}. Try again in {retry} s."
        error = TokensRefused if denial.reason == "tpm" else OpenAIError
        raise error(429, message, code="rate_limit_exceeded", headers={"retry-after": retry, **headers})
    if denial.reason == "tpm_too_large":
        message = (
            f"Request too large for {scope.label}: it reserves {reserve} tokens (prompt plus max_tokens) "
            f"but the limit is {scope.tpm} tokens per minute. Lower max_tokens or shorten the prompt."
        )
        raise TokensRefused(400, message, param="max_tokens", code="tokens_exceed_rate_limit")
    if denial.reason == "concurrency":
        message = (
            f"Too many concurrent requests for {scope.label}: at most {scope.concurrency} at a time. "
            "Try again when one finishes."
        )
        raise OpenAIError(429, message, code="concurrency_limit_exceeded", headers={"retry-after": retry})
    budget = denial.budget
    assert budget is not None, denial
    if budget.metric == "tokens":
        need = f"{admission.reserved_tokens} tokens"
    else:
        need = format(from_nano(admission.reserved_nano), "f")
    reset = resets_at(budget.period, admission.day)
    message = (
        f"The {budget.describe()} for {scope.label} cannot cover this request's worst case ({need}: "
        "prompt plus max_tokens); "
    )
    budget_headers: dict[str, str] = {}
    if reset is None:
        message += "it does not reset."
    else:
        message += f"it resets at {reset:%Y-%m-%dT%H:%M:%SZ}."
        seconds = max(1, int((reset - admission.admitted_at).total_seconds()))
        budget_headers["retry-after"] = str(seconds)
    raise TokensRefused(
        settings.budget_status if budget.metric == "tokens" else settings.spend_budget_status,
        message,
        code="insufficient_quota",
        type="insufficient_quota",
        headers=budget_headers,
    )
