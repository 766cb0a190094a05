"""The proxy's metering: one :class:`UsageRecord` per finished request, journaled before the answer ends.

:meth:`UsageHook.commit` runs while the answer is still open (the proxy's ``UsageJournal``) and
waits for the journal's fsync; the completion hook (``__call__``) then only records what ended
otherwise (a client that left, a failure), without waiting: that answer is already over.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from prometheus_client import Counter as CounterChild

from gateway.metrics import TOKENS
from gateway.proxy.outcome import RelayOutcome
from gateway.usage.recorder import UsageRecorder
from gateway.usage.schemas import UsageRecord


def record_from_outcome(outcome: RelayOutcome) -> UsageRecord | None:
    """None for requests that never reached an engine (an unknown model, no healthy engine: a client
    must not be able to write rows, or model names into reports, by asking for what is not served)
    and for requests without a tenant and key (never the case for inference keys)."""
    if outcome.engine_url is None or outcome.tenant_id is None or outcome.key_id is None:
        return None
    started = datetime.fromtimestamp(outcome.started_at, UTC)
    return UsageRecord(
        request_id=outcome.request_id,
        tenant_id=outcome.tenant_id,
        key_id=outcome.key_id,
        model=outcome.model,
        endpoint=outcome.endpoint,
        prompt_tokens=outcome.prompt_tokens,
        cached_tokens=outcome.cached_tokens,
        completion_tokens=outcome.completion_tokens,
        reasoning_tokens=outcome.reasoning_tokens,
        status=outcome.status,
        finish_reason=outcome.finish_reason,
        ttft_ms=None if outcome.ttft_s is None else outcome.ttft_s * 1000,
        duration_ms=outcome.duration_s * 1000,
        started_at=started,
        finished_at=started + timedelta(seconds=outcome.duration_s),
        usage_estimated=not outcome.usage_exact,
        end_user=outcome.end_user,
    )


class UsageHook:
    def __init__(self, recorder: UsageRecorder) -> None:
        self.recorder = recorder
        self.instance_id = recorder.journal.instance_id

    async def __call__(self, outcome: RelayOutcome) -> None:
        if outcome.committed:
            return
        record = record_from_outcome(outcome)
        if record is not None:
            self.recorder.record(record)
            count_tokens(record)

    async def commit(self, outcome: RelayOutcome) -> None:
        record = record_from_outcome(outcome)
        if record is not None:
            durable = self.recorder.record(record)
            count_tokens(record)
            await durable

    def progress(self, outcome: RelayOutcome) -> None:
        record = record_from_outcome(outcome)
        if record is not None:
            self.recorder.snapshot(record)


_token_counters: dict[tuple[str, str, str], CounterChild] = {}
"""``tern_tokens_total``'s children by labels: ``labels()`` costs about 2 us a call (a lock and a
tuple of strings), three times a request; the children live as long as the counter anyway."""


def count_tokens(record: UsageRecord) -> None:
    """``tern_tokens_total``, from the same numbers as the usage row (cached is part of prompt)."""
    for kind, tokens in (
        ("prompt", record.prompt_tokens),
        ("cached", record.cached_tokens),
        ("completion", record.completion_tokens),
    ):
        if tokens:
            labels = (record.tenant_id, record.model, kind)
            counter = _token_counters.get(labels)
            if counter is None:
                counter = _token_counters[labels] = TOKENS.labels(*labels)
            counter.inc(tokens)
