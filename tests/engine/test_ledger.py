"""The engine's ledger: a tagged request's usage is kept after its RPC stream is cut (the gateway
died), exact and final, for a restarted gateway to bill; untagged requests are not kept."""

from __future__ import annotations

import httpx
import pytest
from test_server import engine_paused_after_first_output, tiny_server, wait_until  # noqa: F401

from engine.core.llm_engine import LLMEngine
from protocol.rpc import Ledger
from tests.gateway.live_server import ServerThread

TAG = {"instance": "gw1", "tenant_id": "t", "key_id": "k", "model": "tiny", "endpoint": "completions"}


def ledger(url: str, instance: str) -> Ledger:
    response = httpx.get(f"{url}/rpc/v1/ledger", params={"instance": instance})
    assert response.status_code == 200
    return Ledger.model_validate_json(response.content)


def test_a_cut_stream_is_in_the_ledger_with_what_the_engine_generated(
    tiny_server: tuple[ServerThread, LLMEngine],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server, engine = tiny_server
    body = {
        "request_id": "cut-1",
        "prompt": "abc",
        "sampling": {"max_tokens": 120, "temperature": 0},
        "ledger_tag": {**TAG, "started_at": 1.5},
    }
    with engine_paused_after_first_output(engine, monkeypatch):
        with httpx.stream("POST", f"{server.url}/rpc/v1/generate", json=body, timeout=60) as response:
            lines = response.iter_lines()  # kept: a dropped iterator would close the stream
            next(lines)
            [entry] = ledger(server.url, "gw1").entries
            assert entry.state == "running" and entry.prompt_tokens > 0
    assert wait_until(lambda: ledger(server.url, "gw1").entries[0].state != "running")
    [entry] = ledger(server.url, "gw1").entries
    assert entry.state == "aborted" and entry.finish_reason == "abort"
    assert 1 <= entry.completion_tokens < 120 and entry.tag["started_at"] == 1.5

    untagged = {"request_id": "plain", "prompt": "abc", "sampling": {"max_tokens": 2}}
    assert httpx.post(f"{server.url}/rpc/v1/generate", json=untagged, timeout=60).status_code == 200
    finished = {**body, "request_id": "done-1", "sampling": {"max_tokens": 3, "temperature": 0}}
    answer = httpx.post(f"{server.url}/rpc/v1/generate", json=finished, timeout=60).text.splitlines()
    entries = {e.request_id: e for e in ledger(server.url, "gw1").entries}
    assert set(entries) == {"cut-1", "done-1"} and not ledger(server.url, "other").entries
    assert entries["done-1"].state == "finished" and entries["done-1"].completion_tokens == 3
    assert '"completion_tokens":3' in answer[-1]
