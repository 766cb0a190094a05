"""End to end: ``tern up`` with the real default model, real PostgreSQL and Redis, the official client.

One ``tern up`` is started for the whole module (one engine load, tests/e2e/conftest.py) exactly as
``make up`` runs it, with its embedded servers in a temporary data dir. The tests then drive it as a
user would: an operator creates a tenant and a key through the admin API, an application calls it with the
``openai`` package, the usage report shows what the engine reported, a revoked key is refused.
A second, engine-less ``tern up`` (it borrows the first one's engine through ``TERN_ENGINE_URLS``)
checks that a restart reuses the data and keys. The last test stops the first stack and checks
that no process outlives it.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
import pytest
import redis
from running_stack import (
    PROMPT,
    RunningStack,
    client_for,
    new_tenant_and_key,
    sessions_alive,
    start_stack,
    wait_for_usage_rows,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tenant_key(admin: httpx.Client) -> dict[str, Any]:
    return new_tenant_and_key(admin, "e2e")


@pytest.fixture(scope="module")
def client(stack: RunningStack, tenant_key: dict[str, Any]) -> openai.OpenAI:
    return client_for(stack, tenant_key)


# Usage the engine reported to the client, per completion; the usage report must add up to it.
reported_usage: list[openai.types.CompletionUsage] = []


def test_tern_up_is_ready_and_prints_a_working_demo_key(stack: RunningStack) -> None:
    assert httpx.get(f"{stack.url}/readyz").status_code == 200
    output = stack.log()
    assert stack.url in output and stack.admin_key in output and stack.demo_key in output
    assert "from openai import OpenAI" in output and "curl " in output
    models = httpx.get(f"{stack.url}/v1/models", headers={"Authorization": f"Bearer {stack.demo_key}"})
    assert models.status_code == 200, models.text


def test_logs_are_clean_json_not_flooded_by_probes(stack: RunningStack) -> None:
    """Issue 18: start-up polling and the gateway's engine probes leave the logs to real requests,
    and JSON lines carry no terminal colour codes."""
    logs = stack.data_dir / "logs"
    gateway_lines = [line for line in (logs / "gateway.log").read_text().splitlines() if line.startswith("{")]
    assert gateway_lines and all(json.loads(line) for line in gateway_lines)
    assert not any("\\u001b" in line or "color_message" in line for line in gateway_lines)
    readyz = [line for line in gateway_lines if '"path":"/readyz"' in line]
    assert len(readyz) <= 8, f"{len(readyz)} /readyz polls logged while starting"
    engine_log = (logs / "engine.log").read_text()
    assert "/rpc/v1/models" not in engine_log and "/rpc/v1/health" not in engine_log


def test_tern_admin_finds_this_stack_by_itself(stack: RunningStack) -> None:
    """Issue 18, defect 2: from the directory holding `.tern`, no variables needed."""
    result = tern_beside(stack, "admin", "create-tenant", "made-by-the-cli")
    assert result.returncode == 0, result.stderr
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {stack.admin_key}"}) as admin:
        names = [tenant["name"] for tenant in admin.get("/admin/tenants").json()["data"]]
    assert "made-by-the-cli" in names


def tern_beside(stack: RunningStack, *argv: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    """``tern ARGV`` run from the directory holding the stack's ``.tern``, with no Tern variables set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TERN_") and k != "DATABASE_URL"}
    return subprocess.run(
        [sys.executable, "-m", "tern_cli", *argv],
        cwd=stack.data_dir.parent,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_tern_status_shows_what_runs_where_and_the_key_files(stack: RunningStack) -> None:
    result = tern_beside(stack, "status")
    assert result.returncode == 0, result.stderr
    assert stack.url in result.stdout and "ready (database ok, redis ok, engine ok)" in result.stdout
    for name in ("admin_key", "demo_key", "secret"):
        assert str(stack.data_dir / name) in result.stdout
    assert stack.admin_key not in result.stdout and stack.demo_key not in result.stdout, "paths, not keys"
    as_json = json.loads(tern_beside(stack, "status", "--json").stdout)
    assert as_json["ready"] and as_json["gateway_url"] == stack.url
    assert {name for name, process in as_json["processes"].items() if process["alive"]} == set(
        stack.info["pids"]
    )


def test_tern_chat_answers_a_question_from_a_pipe(stack: RunningStack) -> None:
    """``echo ... | tern chat``: one question, the streamed answer, exit 0; the demo key found by itself."""
    result = tern_beside(
        stack, "chat", "--temperature", "0", "--max-tokens", "24", stdin=PROMPT[0]["content"]
    )
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    direct = tern_beside(stack, "chat", "--url", stack.info["engine_urls"][0], "--max-tokens", "4", "Hi")
    assert direct.returncode == 0 and direct.stdout.strip(), direct.stderr  # an engine, no key


def test_tern_chat_keeps_the_conversation_until_cleared(stack: RunningStack) -> None:
    """Each turn sends the whole conversation (the prompt grows); /clear forgets it, /system sets one."""
    turns = ["What is the capital of France?", "And of Italy?", "/clear", "And of Italy?"]
    turns += ["/system Be brief.", "Hi", "/exit", "Ignored"]
    script = "".join(f"{turn}\n" for turn in turns)
    result = tern_beside(
        stack, "chat", "--interactive", "--verbose", "--temperature", "0", "--max-tokens", "16", stdin=script
    )
    assert result.returncode == 0, result.stderr
    usage = [
        [int(word) for word in line.strip("[]").split() if word.isdigit()]
        for line in result.stderr.splitlines()
        if line.startswith("[") and "prompt tokens" in line
    ]
    assert len(usage) == 4, result.stderr  # nothing after /exit
    (first_prompt, first_completion), (second_prompt, _), (cleared_prompt, _), (system_prompt, _) = usage
    assert second_prompt > first_prompt + first_completion, "the first exchange was sent again"
    assert cleared_prompt < second_prompt, "/clear forgot it"
    assert system_prompt != cleared_prompt
    assert "(conversation cleared)" in result.stderr and "(system prompt set" in result.stderr


def test_admin_api_created_the_tenant_and_key(tenant_key: dict[str, Any], admin: httpx.Client) -> None:
    assert tenant_key["key"].startswith("tern_sk_")
    listed = admin.get("/admin/keys", params={"tenant_id": tenant_key["tenant"]["id"]})
    assert listed.status_code == 200
    assert [key["id"] for key in listed.json()["data"]] == [tenant_key["id"]]
    assert tenant_key["key"] not in listed.text


def test_non_streaming_chat_completion(client: openai.OpenAI, model: str) -> None:
    reply = client.chat.completions.create(model=model, messages=PROMPT, max_tokens=24, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.prompt_tokens > 0
    assert 0 < reply.usage.completion_tokens <= 24
    reported_usage.append(reply.usage)


def test_streaming_chat_completion(client: openai.OpenAI, model: str) -> None:
    stream = client.chat.completions.create(
        model=model,
        messages=PROMPT,
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    content_chunks = [chunk for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert len(content_chunks) > 1, "a streamed answer arrives in pieces"
    assert "Paris" in text
    usage = chunks[-1].usage
    assert usage is not None and 0 < usage.completion_tokens <= 24
    reported_usage.append(usage)


def test_usage_report_shows_exactly_the_tokens_the_engine_reported(
    admin: httpx.Client, tenant_key: dict[str, Any]
) -> None:
    assert len(reported_usage) == 2, "runs after the two completions above"
    rows = wait_for_usage_rows(admin, tenant_key["tenant"]["id"], requests=2)
    assert [row["key_id"] for row in rows] == [tenant_key["id"]]
    (row,) = rows
    assert row["requests"] == 2 and row["errors"] == 0
    assert row["prompt_tokens"] == sum(usage.prompt_tokens for usage in reported_usage)
    assert row["completion_tokens"] == sum(usage.completion_tokens for usage in reported_usage)
    assert row["total_tokens"] == sum(usage.total_tokens for usage in reported_usage)


def test_revoked_key_is_refused(
    admin: httpx.Client, stack: RunningStack, tenant_key: dict[str, Any], model: str
) -> None:
    tenant_id = tenant_key["tenant"]["id"]
    created = admin.post("/admin/keys", json={"tenant_id": tenant_id, "name": "doomed", "kind": "inference"})
    assert created.status_code == 201, created.text
    doomed = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=created.json()["key"], max_retries=0)
    assert doomed.models.list().data
    assert admin.post(f"/admin/keys/{created.json()['id']}/revoke").status_code == 200
    deadline = time.monotonic() + 10
    while True:  # the contract is "within 1 s"; poll rather than sleep a fixed time
        try:
            doomed.chat.completions.create(model=model, messages=PROMPT, max_tokens=4)
        except openai.AuthenticationError as refused:
            assert refused.status_code == 401
            assert "revoked" in refused.message
            break
        assert time.monotonic() < deadline, "a revoked key still works after 10 s"
        time.sleep(0.1)


def test_restart_reuses_data_and_keys(stack: RunningStack, workdir: Path) -> None:
    """A second ``tern up`` on its own data dir, borrowing the first one's engine, started twice."""
    data_dir = workdir / "second" / ".tern"
    data_dir.parent.mkdir(mode=0o711)
    borrowed_engine = {"TERN_ENGINE_URLS": ",".join(stack.info["engine_urls"])}

    first = start_stack(data_dir, extra_env=borrowed_engine)
    assert "engine" not in first.info["pids"]
    admin_key, demo_key = first.admin_key, first.demo_key
    with httpx.Client(base_url=first.url, headers={"Authorization": f"Bearer {admin_key}"}) as admin:
        made = admin.post("/admin/tenants", json={"name": "survives-restart"})
        assert made.status_code == 201, made.text
    assert first.stop() == 0, first.log()
    assert not sessions_alive(set(first.info["pids"].values()))

    second = start_stack(data_dir, extra_env=borrowed_engine)
    try:
        assert (second.admin_key, second.demo_key) == (admin_key, demo_key)
        with httpx.Client(base_url=second.url, headers={"Authorization": f"Bearer {admin_key}"}) as admin:
            names = [tenant["name"] for tenant in admin.get("/admin/tenants").json()["data"]]
        assert "survives-restart" in names
        models = httpx.get(f"{second.url}/v1/models", headers={"Authorization": f"Bearer {demo_key}"})
        assert models.status_code == 200
    finally:
        assert second.stop() == 0, second.log()
    assert not sessions_alive(set(second.info["pids"].values()))


def test_external_database_and_redis_are_used_not_started(
    stack: RunningStack, workdir: Path, database_url: str, redis_url: str
) -> None:
    """DATABASE_URL and REDIS_URL (here: the test session's servers) replace the embedded ones."""
    data_dir = workdir / "external" / ".tern"
    data_dir.parent.mkdir(mode=0o711)
    external = {
        "DATABASE_URL": database_url,
        "REDIS_URL": redis_url,
        "TERN_ENGINE_URLS": ",".join(stack.info["engine_urls"]),
    }
    running = start_stack(data_dir, extra_env=external)
    try:
        assert set(running.info["pids"]) == {"watchdog", "gateway"}
        assert not (data_dir / "postgres").exists() and not (data_dir / "redis").exists()
        admin_auth = {"Authorization": f"Bearer {running.admin_key}"}
        with httpx.Client(base_url=running.url, headers=admin_auth) as admin:
            assert admin.post("/admin/tenants", json={"name": "in-the-external-db"}).status_code == 201
        ours = redis.Redis.from_url(redis_url)
        try:
            assert len(ours.client_list()) >= 2, "the gateway is connected to the given Redis"
        finally:
            ours.close()
    finally:
        assert running.stop() == 0, running.log()

    async def tenant_names() -> list[str]:
        conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
        try:
            return [row["name"] for row in await conn.fetch("SELECT name FROM tenants")]
        finally:
            await conn.close()

    assert "in-the-external-db" in asyncio.run(tenant_names())


def test_sigterm_stops_everything_with_no_orphans(stack: RunningStack) -> None:
    """Runs last: stops the module's stack."""
    pids = set(stack.info["pids"].values())
    assert {"postgres", "redis", "engine", "gateway", "watchdog"} <= set(stack.info["pids"])
    assert sessions_alive(pids)
    assert stack.stop() == 0, stack.log()
    assert not sessions_alive(pids), stack.log()
    assert not (stack.data_dir / "run.json").exists()
    output = stack.log()
    order = [
        output.index(f"stopping {name}") for name in ("the gateway", "the engine", "Redis", "PostgreSQL")
    ]
    assert order == sorted(order), "the gateway stops first, the databases last"
