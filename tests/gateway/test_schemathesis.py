"""Schemathesis against a real gateway: every operation in /openapi.json, all phases, with an admin key
and with a tenant's inference key. No server error, and no response that contradicts the document.

Bounded in time: few examples per operation (``MAX_EXAMPLES``) and a timeout on the whole run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from credentials import TEST_ADMIN_KEY
from fake_engine import FakeEngine
from live_server import ServerThread, create_inference_key

from gateway.app import create_app
from gateway.config import Settings

pytestmark = pytest.mark.fake_engines(count=1)

MAX_EXAMPLES = 15
RUN_TIMEOUT_S = 240


@pytest.fixture
def gateway(gateway_settings: Settings, fake_engine: FakeEngine) -> Iterator[ServerThread]:
    server = ServerThread(create_app(gateway_settings)).start()
    yield server
    server.stop()


def schemathesis(gateway: ServerThread, key: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    command = [
        str(Path(sys.executable).with_name("st")),
        "run",
        f"{gateway.url}/openapi.json",
        "--header",
        f"Authorization: Bearer {key}",
        "--checks",
        "all",
        "--phases",
        "examples,coverage,fuzzing,stateful",
        "--max-examples",
        str(MAX_EXAMPLES),
        "--request-timeout",
        "20",
        "--seed",
        "1",
        "--no-color",
        "--report",
        "junit",
        "--report-dir",
        str(tmp_path),
    ]
    env = os.environ | {"SCHEMATHESIS_HOOKS": str(Path(__file__).with_name("schemathesis_hooks.py"))}
    return subprocess.run(
        command, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False, env=env
    )


@pytest.mark.parametrize("who", ["admin", "tenant"])
def test_schemathesis_finds_no_server_error_and_no_schema_violation(
    gateway: ServerThread, who: str, tmp_path: Path
) -> None:
    if who == "admin":
        key = TEST_ADMIN_KEY
    else:
        key = create_inference_key(gateway.url, TEST_ADMIN_KEY)
    document = httpx.get(f"{gateway.url}/openapi.json")  # public, like the code: routes, never data
    assert document.status_code == 200
    assert {"/v1/chat/completions", "/v1/completions"} <= set(document.json()["paths"])  # the direct lane too
    result = schemathesis(gateway, key, tmp_path)
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
