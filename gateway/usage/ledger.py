"""Billing the streams a dead gateway process cut, from the engines' ledgers (``engine/serving/ledger.py``).

When a replay finds dead processes (:class:`Recovered.instances`), :class:`LedgerRecovery` asks every
Tern engine for the requests those processes tagged, once the engine has seen each of them end (the
dead process's connections closing aborts them), and stores a row for each: what the engine
generated, which is at least what the client received. Rows the journal already held (answers that
completed) keep theirs: both have the same request id and start time, and the insert skips
duplicates. ``openai``-kind engines keep no ledger; their streams are billed from the journal's
in-flight snapshots instead (``journal.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from datetime import UTC, date, datetime

import aiohttp

from gateway.proxy.engine_pool import EnginePool, Upstream
from gateway.proxy.outcome import CUT_BY_GATEWAY_STATUS
from gateway.usage.recorder import Recovered, UsageRecorder
from gateway.usage.schemas import UsageRecord
from gateway.usage.service import write_batch
from protocol.rpc import LEDGER_PATH, Ledger, LedgerEntry

log = logging.getLogger(__name__)

GIVE_UP_S = 120.0
"""How long to keep asking an engine that is down or still running a dead process's request."""
RETRY_S = 0.5


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
        self._known_months: set[date] = set()

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
        deadline = time.monotonic() + GIVE_UP_S
        while True:
            try:
                if await self._bill(upstream, instance):
                    return
            except Exception as exc:  # the engine or Postgres is away: ask again
                log.info("ledger of %s for %s not read yet: %s", upstream.url, instance, exc)
            if time.monotonic() > deadline:
                log.error("gave up billing the streams %s cut on %s", instance, upstream.url)
                return
            await asyncio.sleep(RETRY_S)

    async def _bill(self, upstream: Upstream, instance: str) -> bool:
        """Store the dead process's requests on this engine; False while one is still running."""
        async with upstream.session.get(LEDGER_PATH, params={"instance": instance}) as response:
            if response.status != 200:
                raise aiohttp.ClientResponseError(
                    response.request_info, (), status=response.status, message="ledger refused"
                )
            ledger = Ledger.model_validate_json(await response.read())
        if any(e.state == "running" for e in ledger.entries):
            return False
        records = [r for e in ledger.entries if (r := record_from_entry(e)) is not None]
        if not records:
            return True
        new = await write_batch(self.recorder.engine, records, known_months=self._known_months)
        self.recorder.flushed += new
        log.warning(
            "billed %d requests a dead gateway (%s) cut on %s from its ledger", new, instance, upstream.url
        )
        if new:
            await self.recorder.recovered(Recovered(records, new))
        return True
