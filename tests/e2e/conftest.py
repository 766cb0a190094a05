"""The end-to-end tests' fixtures: one ``tern up`` per test module (module-scoped), as ``make up`` runs it.

Each module that asks for ``stack`` starts its own (one engine load), so a module that stops or
restarts its stack (test_stack.py's last tests) leaves the others' alone.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from console_browser import CHROMIUM, CHROMIUM_ARGS
from playwright.sync_api import Browser, BrowserContext, Page, Playwright, sync_playwright
from running_stack import STOP_DEADLINE_S, RunningStack, start_stack


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    # Not pytest's tmp_path: that is 0700, and PostgreSQL runs as another account when we are root.
    path = Path(tempfile.mkdtemp(prefix="tern-e2e-", dir="/tmp"))
    path.chmod(0o711)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def stack(workdir: Path) -> Iterator[RunningStack]:
    running = start_stack(workdir / ".tern")
    yield running
    if running.process.poll() is None:
        os.killpg(running.process.pid, signal.SIGTERM)
        running.process.wait(timeout=STOP_DEADLINE_S)


@pytest.fixture(scope="module")
def admin(stack: RunningStack) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=stack.url, headers={"Authorization": f"Bearer {stack.admin_key}"}, timeout=30.0
    ) as client:
        yield client


@pytest.fixture(scope="module")
def model(stack: RunningStack) -> str:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=stack.demo_key)
    return client.models.list().data[0].id


# -- the console's browser (test_console.py): one Chromium per module, a fresh profile per test --------


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    yield browser
    browser.close()


@pytest.fixture
def context(browser: Browser, stack: RunningStack) -> Iterator[BrowserContext]:
    """A fresh browser profile per test (its own sessionStorage), with downloads allowed."""
    context = browser.new_context(
        base_url=stack.url, viewport={"width": 1280, "height": 800}, accept_downloads=True
    )
    yield context
    context.close()


@pytest.fixture
def page(context: BrowserContext) -> Iterator[Page]:
    """A page that fails the test on any script error or CSP violation, and accepts confirmations."""
    page = context.new_page()
    problems: list[str] = []
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("console", lambda msg: problems.append(msg.text) if msg.type == "error" else None)
    page.on("dialog", lambda dialog: dialog.accept())
    yield page
    # 4xx answers the console shows to the user are logged by Chromium as failed loads; not bugs.
    assert [p for p in problems if "Failed to load resource" not in p] == []
