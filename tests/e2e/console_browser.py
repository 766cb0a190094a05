"""The console tests' browser side: Chromium's flags, and what a user does on a page (sign in, open a
page from the nav, find a row) as steps the tests share. The fixtures are in tests/e2e/conftest.py."""

from __future__ import annotations

import shutil

import httpx
from playwright.sync_api import Locator, Page, expect

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
NAV = ["Tenants", "Keys", "Limits", "Usage", "Engines", "Audit", "Playground"]
ANSWER_TIMEOUT_MS = 120_000  # the real model on a busy two-core machine
# Playwright waits 5 s by default; a page render behind the real stack on a loaded two-core CI
# machine has taken longer (a tenant row missed it once), and a wait ends as soon as it holds.
expect.set_options(timeout=20_000)


def sign_in(page: Page, key: str) -> None:
    page.goto("/")
    page.get_by_label("Admin key").fill(key)
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("heading", name="Tenants")).to_be_visible()


def go(page: Page, name: str) -> None:
    """Open a page from the nav and wait until it is drawn: the click returns before the
    hashchange handler runs, and until then the previous page's fields are still there."""
    page.get_by_role("navigation").get_by_role("link", name=name, exact=True).click()
    expect(page.get_by_role("heading", name=name, level=1)).to_be_visible()  # "Audit log", "Limits and .."


def row(page: Page, text: str) -> Locator:
    return page.get_by_role("row").filter(has_text=text)


def create_tenant(page: Page, name: str) -> None:
    go(page, "Tenants")
    page.get_by_label("Tenant name").fill(name)
    page.get_by_role("button", name="Create tenant").click()
    expect(row(page, name)).to_be_visible()


def requests_recorded(admin: httpx.Client, tenant_id: str) -> int:
    report = admin.get("/admin/reports/usage", params={"tenant": tenant_id, "group_by": "day"})
    return int(report.json()["totals"]["requests"])


def usage_rows(page: Page) -> list[str]:
    return page.get_by_role("table", name="Usage rows").get_by_role("row").all_inner_texts()
