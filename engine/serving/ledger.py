"""The engine's short memory of the gateway's requests, for billing the streams a gateway crash cut.

A gateway that dies mid-stream takes its count of the tokens it relayed with it; the engine still
knows what it generated. Each request that carries a ``ledger_tag`` (the gateway's request id,
tenant, key and process) gets an entry: prompt tokens at start, generated tokens as they are made,
the exact usage once it finishes or is aborted (the RPC stream closing aborts it). A restarted
gateway reads the entries of its dead predecessor (``GET /rpc/v1/ledger?instance=``) and bills the
ones it has no usage row for. Entries are kept ``KEEP_S`` after they end, at most ``MAX_ENTRIES``.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from engine.core.outputs import RequestOutput
from protocol.rpc import LedgerEntry

KEEP_S = 900.0
MAX_ENTRIES = 100_000


class RequestLedger:
    def __init__(self, *, keep_s: float = KEEP_S, max_entries: int = MAX_ENTRIES) -> None:
        self.keep_s = keep_s
        self.max_entries = max_entries
        self._entries: OrderedDict[str, LedgerEntry] = OrderedDict()

    def start(self, request_id: str, tag: dict[str, str | float], prompt_tokens: int) -> None:
        self._entries[request_id] = LedgerEntry(
            request_id=request_id, tag=tag, state="running", prompt_tokens=prompt_tokens
        )
        self._prune()

    def forget(self, request_id: str) -> None:
        """The request was refused before any work (nothing to bill)."""
        self._entries.pop(request_id, None)

    def record(self, out: RequestOutput) -> None:
        entry = self._entries.get(out.request_id)
        if entry is None or entry.state != "running":
            return
        entry.completion_tokens += sum(len(d.token_ids) for d in out.deltas)
        usage = out.usage
        if usage is not None:
            entry.prompt_tokens = usage.prompt_tokens
            entry.cached_tokens = usage.cached_tokens
            entry.completion_tokens = usage.completion_tokens
            entry.finish_reason = usage.finish_reason
            entry.state = "aborted" if usage.finish_reason == "abort" else "finished"
            entry.ended_at = time.time()

    def entries(self, instance: str) -> list[LedgerEntry]:
        return [e for e in self._entries.values() if e.tag.get("instance") == instance]

    def _prune(self) -> None:
        cutoff = time.time() - self.keep_s
        while self._entries:
            oldest = next(iter(self._entries.values()))
            too_many = len(self._entries) > self.max_entries
            expired = oldest.ended_at is not None and oldest.ended_at < cutoff
            if not (too_many or expired):
                return
            self._entries.popitem(last=False)
