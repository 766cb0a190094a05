"""Billing the streams a dead gateway process cut, from the engines' ledgers (``engine/serving/ledger.py``).

When a replay finds dead processes (:class:`Recovered.instances`), :class:`LedgerRecovery` asks every
Tern engine for the requests those processes tagged, once the engine has seen each of them end (the
dead process's connections closing aborts them), and stores a row for each: what the engine
generated, which is at least what the client received. Rows the journal already held (answers that
completed) keep theirs: both have the same request id and start time, and the insert skips
duplicates. ``openai``-kind engines keep no ledger; their streams are billed from the journal's
in-flight snapshots instead (``journal.py``).

The rows are written through the recorder (:meth:`UsageRecorder.store`), so a row Postgres rejects is
quarantined like a journal line, and a Postgres outage is waited out: the ledger, once read, is kept
and written when Postgres answers, however long that takes. The recovery gives up on one decision
only, logged and counted (``tern_usage_ledger_recoveries_abandoned_total``): the engine did not
answer, or still ran one of the dead process's requests, for ``GIVE_UP_S`` (an engine that restarted
lost its ledger with its memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, datetime

import aiohttp

from gateway.metrics import USAGE_LEDGER_ABANDONED
from gateway.proxy.engine_pool import EnginePool, Upstream
from gateway.proxy.outcome import CUT_BY_GATEWAY_STATUS
from gateway.usage.recorder import Recovered, UsageRecorder
from gateway.usage.schemas import UsageRecord
from protocol.rpc import LEDGER_PATH, Ledger, LedgerEntry

log = logging.getLogger(__name__)

GIVE_UP_S = 120.0
"""How long to keep asking an engine that is down or still running a dead process's request (a
Postgres outage does not count: rows already read wait for it)."""
RETRY_S = 0.5
MAX_RETRY_S = 5.0


def record_from_entry(entry: LedgerEntry) -> UsageRecord | None:
    tag = entry.tag
    try:
        started = datetime.fromtimestamp(float(tag["started_at"]), UTC)
        ended = datetime.fromtimestamp(entry.ended_at or time.time(), UTC)
        return UsageRecord(
            request_id=entry.request_id,
            tenant_id=str(tag["tenant_id"]),
            key_id=str(tag["key_id"]),
            model=str(tag["model"]),
            endpoint=str(tag["endpoint"]),
            prompt_tokens=entry.prompt_tokens,
            cached_tokens=entry.cached_tokens,
            completion_tokens=entry.completion_tokens,
            status=CUT_BY_GATEWAY_STATUS,
            finish_reason=entry.finish_reason or "abort",
            ttft_ms=None,
            duration_ms=max(0.0, (ended - started).total_seconds() * 1000),
            started_at=started,
            finished_at=ended,
        )
    except (KeyError, TypeError, ValueError):
        log.error("ledger entry %s has an unusable tag: %r", entry.request_id, tag)
        return None


class LedgerRecovery:
    """A recovery hook of the recorder (``UsageRecorder.on_recovered``)."""

    def __init__(self, *, pool: EnginePool, recorder: UsageRecorder) -> None:
        self.pool = pool
        self.recorder = recorder
        self._tasks: set[asyncio.Task[None]] = set()

    async def __call__(self, recovered: Recovered) -> None:
        for upstream in self.pool.upstreams:
            if upstream.kind != "tern":
                continue
            for instance in recovered.instances:
                task = asyncio.get_running_loop().create_task(self._recover(upstream, instance))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _recover(self, upstream: Upstream, instance: str) -> None:
        records = await self._read(upstream, instance)
        if not records:
            return
        delay = RETRY_S
        while True:
            try:
                new = await self.recorder.store(records)
                break
            except Exception as exc:  # Postgres is down: the rows wait for it, however long
                log.info("ledger rows of %s wait for Postgres: %s", instance, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RETRY_S)
        self.recorder.flushed += new
        log.warning(
            "billed %d requests a dead gateway (%s) cut on %s from its ledger", new, instance, upstream.url
        )
        if new:
            await self.recorder.recovered(Recovered(records, new))

    async def _read(self, upstream: Upstream, instance: str) -> list[UsageRecord]:
        """The dead process's requests on this engine, once none of them runs; [] after giving up."""
        deadline = time.monotonic() + GIVE_UP_S
        reason = "engine_unreachable"
        while True:
            try:
                ledger = await self._fetch(upstream, instance)
                if not any(e.state == "running" for e in ledger.entries):
                    return [r for e in ledger.entries if (r := record_from_entry(e)) is not None]
                reason = "still_running"
            except Exception as exc:  # the engine is away: ask again
                reason = "engine_unreachable"
                log.info("ledger of %s for %s not read yet: %s", upstream.url, instance, exc)
            if time.monotonic() > deadline:
                USAGE_LEDGER_ABANDONED.labels(reason).inc()
                log.error(
                    "gave up billing the streams %s cut on %s after %.0f s (%s)",
                    instance,
                    upstream.url,
                    GIVE_UP_S,
                    reason,
                )
                return []
            await asyncio.sleep(RETRY_S)

    @staticmethod
    async def _fetch(upstream: Upstream, instance: str) -> Ledger:
        async with upstream.session.get(LEDGER_PATH, params={"instance": instance}) as response:
            if response.status != 200:
                raise aiohttp.ClientResponseError(
                    response.request_info, (), status=response.status, message="ledger refused"
                )
            return Ledger.model_validate_json(await response.read())
