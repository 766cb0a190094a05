"""The web console in a real Chromium (Debian's ``chromium``, driven by Playwright) against a real
``tern up``: real PostgreSQL, Redis and the real default model.

The stack and the browser come from tests/e2e/conftest.py (this module gets its own ``tern up``);
the steps a user takes on a page from console_browser.py. Controls are found by role and accessible
name, as a screen reader would find them.

With ``TERN_CONSOLE_SCREENSHOTS=DIR`` set, ``test_every_page_renders`` also saves a 1280x800
screenshot of each page there (docs/images/ holds the committed ones; see docs/console.md).
"""

from __future__ import annotations

import csv
import io
import os
import re
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import httpx
import pytest
from console_browser import (
    ANSWER_TIMEOUT_MS,
    NAV,
    create_tenant,
    go,
    requests_recorded,
    row,
    sign_in,
)
from playwright.sync_api import BrowserContext, Page, expect
from running_stack import RunningStack

pytestmark = pytest.mark.slow


def test_root_shows_the_sign_in_page_with_security_headers(page: Page, stack: RunningStack) -> None:
    response = page.goto("/")
    assert response is not None and response.url == f"{stack.url}/ui/"
    assert response.headers["x-frame-options"] == "DENY"
    assert "unsafe-inline" not in response.headers["content-security-policy"]
    expect(page.get_by_label("Admin key")).to_be_visible()
    expect(page.get_by_role("navigation")).to_be_hidden()

    page.get_by_label("Admin key").fill("tern_sk_not-a-real-key")
    page.get_by_role("button", name="Sign in").click()
    expect(page.get_by_role("alert")).to_contain_text("key")
    expect(page.get_by_role("navigation")).to_be_hidden()


def test_sign_in_keeps_the_key_in_session_storage_only_and_sign_out_forgets_it(
    page: Page, context: BrowserContext, stack: RunningStack
) -> None:
    sign_in(page, stack.admin_key)
    assert stack.admin_key not in page.url
    assert context.cookies() == []
    page.reload()
    expect(page.get_by_role("heading", name="Tenants")).to_be_visible()  # same tab: still signed in
    other_tab = context.new_page()
    other_tab.goto("/")
    expect(other_tab.get_by_label("Admin key")).to_be_visible()  # a new tab has its own session
    other_tab.close()

    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_label("Admin key")).to_be_visible()
    assert page.evaluate("sessionStorage.length") == 0
    page.reload()
    expect(page.get_by_label("Admin key")).to_be_visible()


def test_tenant_and_key_lifecycle(page: Page, stack: RunningStack, admin: httpx.Client) -> None:
    sign_in(page, stack.admin_key)
    tenant = f"console-{uuid.uuid4().hex[:6]}"
    create_tenant(page, tenant)

    go(page, "Keys")
    page.get_by_label("Tenant", exact=True).select_option(label=tenant)
    page.get_by_label("Key name").fill("app key")
    page.get_by_label("Requests per minute").fill("0")
    page.get_by_role("button", name="Create key").click()
    # The API's validation error, next to its field.
    expect(page.locator('[data-error-for="rpm_limit"]')).to_contain_text("rpm_limit")
    expect(page.get_by_label("Requests per minute")).to_have_attribute("aria-invalid", "true")

    page.get_by_label("Requests per minute").fill("600")
    page.get_by_role("button", name="Create key").click()
    secret = page.get_by_label("New key").inner_text()
    assert secret.startswith("tern_sk_")
    expect(page.get_by_role("button", name="Copy key")).to_be_visible()
    auth = {"Authorization": f"Bearer {secret}"}
    assert httpx.get(f"{stack.url}/v1/models", headers=auth).status_code == 200
    key_row = row(page, "app key")
    expect(key_row).to_contain_text("Requests per minute: 600")
    expect(key_row).to_contain_text("active")

    go(page, "Tenants")
    go(page, "Keys")  # shown once: gone after leaving the page
    expect(row(page, "app key")).to_be_visible()
    assert secret not in page.content()

    row(page, "app key").get_by_role("button", name="Edit").click()
    edit = page.get_by_role("form", name="Edit key app key")
    edit.get_by_label("Models").fill("model-a, model-b")
    edit.get_by_role("button", name="Save key").click()
    expect(row(page, "app key")).to_contain_text("model-a, model-b")

    row(page, "app key").get_by_role("button", name="Revoke").click()
    expect(row(page, "app key")).to_contain_text("revoked")
    assert httpx.get(f"{stack.url}/v1/models", headers=auth).status_code == 401

    # Rotation with a grace period: a new secret, shown once; the old one works until the grace ends.
    page.get_by_label("Key name").fill("rotating key")
    page.get_by_role("button", name="Create key").click()
    old_secret = page.get_by_label("New key").inner_text()
    row(page, "rotating key").get_by_role("button", name="Rotate").click()
    page.get_by_label("Grace period (seconds)").fill("600")
    page.get_by_role("button", name="Rotate key").click()
    expect(page.get_by_role("region", name="Key “rotating key” rotated")).to_be_visible()
    new_secret = page.get_by_label("New key").inner_text()
    assert new_secret.startswith("tern_sk_") and new_secret != old_secret
    expect(row(page, "rotating key")).to_have_count(2)
    expect(row(page, "rotating key").filter(has_text="expires")).to_have_count(1)
    for secret_ in (old_secret, new_secret):
        models = httpx.get(f"{stack.url}/v1/models", headers={"Authorization": f"Bearer {secret_}"})
        assert models.status_code == 200

    go(page, "Tenants")
    row(page, tenant).get_by_role("button", name="Suspend").click()
    expect(row(page, tenant)).to_contain_text("suspended")
    row(page, tenant).get_by_role("button", name="Resume").click()
    expect(row(page, tenant)).to_contain_text("active")

    go(page, "Audit")
    expect(page.get_by_role("row").filter(has_text="key.revoke").first).to_be_visible()


def test_playground_answer_shows_in_the_usage_chart_and_csv(
    page: Page, stack: RunningStack, admin: httpx.Client, tmp_path: Path
) -> None:
    sign_in(page, stack.admin_key)
    tenant = f"playground-{uuid.uuid4().hex[:6]}"
    create_tenant(page, tenant)
    tenant_id = next(t["id"] for t in admin.get("/admin/tenants").json()["data"] if t["name"] == tenant)

    go(page, "Usage")
    page.get_by_label("Tenant", exact=True).select_option(label=tenant)
    expect(page.get_by_text("No usage in this period.")).to_be_visible()

    go(page, "Playground")
    page.get_by_label("Tenant", exact=True).select_option(label=tenant)
    page.get_by_role("button", name="Create inference key").click()

    expect(page.get_by_text("model(s) available")).to_be_visible()
    page.get_by_label("Max tokens").fill("12")
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Message").fill("What is the capital of France?")
    page.get_by_role("button", name="Send").click()
    answer = page.locator(".bubble.assistant").last
    expect(answer.locator(".stats")).to_contain_text("tokens/s", timeout=ANSWER_TIMEOUT_MS)
    expect(answer.locator(".stats")).to_contain_text("TTFT")
    stats = answer.locator(".stats").inner_text()
    completion_tokens = int(re.search(r"\+ (\d+) completion tokens", stats).group(1))
    assert 0 < completion_tokens <= 12
    assert answer.locator("p").first.inner_text().strip()

    # A second turn carries the first (multi-turn): the prompt grows.
    page.get_by_label("Message").fill("And of Italy?")
    page.get_by_role("button", name="Send").click()
    expect(page.locator(".bubble.assistant")).to_have_count(2)
    expect(page.locator(".bubble.assistant").last.locator(".stats")).to_be_visible(timeout=ANSWER_TIMEOUT_MS)
    first_prompt, second_prompt = (
        int(re.search(r"usage: (\d+) prompt", s).group(1))
        for s in page.locator(".bubble.assistant .stats").all_inner_texts()
    )
    assert second_prompt > first_prompt

    go(page, "Usage")
    page.get_by_label("Tenant", exact=True).select_option(label=tenant)
    deadline = time.monotonic() + 30
    while requests_recorded(admin, tenant_id) < 2:  # usage is flushed to the database in the background
        assert time.monotonic() < deadline, "the two playground requests were not recorded in 30 s"
        time.sleep(0.5)
    page.get_by_role("button", name="Show usage").click()
    today = datetime.now(UTC).date().isoformat()
    expect(page.get_by_role("table", name="Usage rows")).to_contain_text(today)
    expect(page.get_by_role("img", name=re.compile("Requests per day"))).to_be_visible()
    expect(page.locator("svg.chart rect")).to_have_count(1)  # one day with requests

    page.get_by_label("Break down by").select_option("key")  # redraws at once
    expect(page.locator("figure .legend")).to_contain_text("playground (tern_sk_")
    page.get_by_label("Break down by").select_option("")

    is_csv_request = lambda r: "/admin/reports/usage" in r.url and "format=csv" in r.url  # noqa: E731
    with page.expect_download() as download_info, page.expect_request(is_csv_request) as request_info:
        page.get_by_role("button", name="Download CSV").click()
    downloaded = tmp_path / "usage.csv"
    download_info.value.save_as(downloaded)
    # The CSV is the report of the query on screen: this tenant, the form's days, one row per day.
    sent = dict(parse_qsl(urlsplit(request_info.value.url).query))
    assert sent == {
        "tenant": tenant_id,
        "from": page.get_by_label("From", exact=True).input_value(),
        "to": page.get_by_label("To", exact=True).input_value(),
        "group_by": "day",
        "format": "csv",
    }
    api_csv = admin.get("/admin/reports/usage", params=sent).content
    assert downloaded.read_bytes() == api_csv
    api_csv_text = api_csv.decode()
    rows: list[dict[str, Any]] = list(csv.DictReader(io.StringIO(api_csv_text)))
    assert [(r["day"], r["requests"]) for r in rows] == [(today, "2")]
    assert int(rows[0]["prompt_tokens"]) > 0


def test_a_budget_set_in_the_console_shows_its_bar_and_the_bar_moves_after_traffic(
    page: Page, stack: RunningStack, admin: httpx.Client
) -> None:
    sign_in(page, stack.admin_key)
    tenant = f"budget-{uuid.uuid4().hex[:6]}"
    create_tenant(page, tenant)
    tenant_id = next(t["id"] for t in admin.get("/admin/tenants").json()["data"] if t["name"] == tenant)
    key = admin.post("/admin/keys", json={"tenant_id": tenant_id, "name": "budgeted", "kind": "inference"})
    secret = key.json()["key"]

    go(page, "Limits")
    page.get_by_label("Tenant", exact=True).select_option(label=tenant)
    form = page.get_by_role("form", name="Add budget")
    form.get_by_label("For").select_option(label="key budgeted")
    form.get_by_label("Period").select_option("day")
    form.get_by_label("Amount").fill("100000")
    form.get_by_label("Alert at (%)").fill("80")
    form.get_by_role("button", name="Add budget").click()
    bar = page.get_by_role("meter", name="Key budgeted: tokens per day")
    expect(bar).to_have_attribute("aria-valuenow", "0")
    expect(bar).to_have_attribute(
        "aria-valuetext", re.compile(r"^0 of 100000; resets \d{4}-\d\d-\d\d 00:00:00 UTC$")
    )
    [saved] = admin.get("/admin/budgets", params={"tenant": tenant_id}).json()["data"]
    assert (saved["metric"], saved["period"], saved["limit"], saved["alert_ratio"]) == (
        "tokens",
        "day",
        "100000",
        0.8,
    )

    inference = {"Authorization": f"Bearer {secret}"}
    model = httpx.get(f"{stack.url}/v1/models", headers=inference).json()["data"][0]["id"]
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    answer = httpx.post(f"{stack.url}/v1/chat/completions", json=chat, headers=inference, timeout=120)
    assert answer.status_code == 200, answer.text
    assert int(answer.headers["x-tern-budget-remaining-tokens"]) < 100000
    used = answer.json()["usage"]["total_tokens"]
    deadline = time.monotonic() + 30
    while admin.get("/admin/budgets", params={"tenant": tenant_id}).json()["data"][0]["used"] != str(used):
        assert time.monotonic() < deadline, "the request was never settled against the budget"
        time.sleep(0.2)

    go(page, "Usage")
    page.get_by_label("Tenant", exact=True).select_option(label=tenant)
    moved = page.get_by_role("meter", name="Key budgeted: tokens per day")
    expect(moved).to_have_attribute("aria-valuenow", str(used))
    expect(moved).to_have_attribute("aria-valuetext", re.compile(f"^{used} of 100000; resets "))


def test_tenant_admin_sees_only_its_own_tenant(page: Page, stack: RunningStack, admin: httpx.Client) -> None:
    mine, theirs = (f"{name}-{uuid.uuid4().hex[:6]}" for name in ("mine", "theirs"))
    ids = {}
    for name in (mine, theirs):
        created = admin.post("/admin/tenants", json={"name": name})
        assert created.status_code == 201, created.text
        ids[name] = created.json()["id"]
    their_key = admin.post(
        "/admin/keys", json={"tenant_id": ids[theirs], "name": "their secret app", "kind": "inference"}
    ).json()
    tenant_admin = admin.post(
        "/admin/keys", json={"tenant_id": ids[mine], "name": "my admin", "kind": "admin"}
    ).json()["key"]

    sign_in(page, tenant_admin)
    expect(row(page, mine)).to_be_visible()
    expect(page.get_by_text(theirs)).to_have_count(0)

    go(page, "Keys")
    expect(page.get_by_label("Tenant", exact=True).locator("option")).to_have_text([mine])
    expect(row(page, "my admin")).to_be_visible()
    expect(page.get_by_text("their secret app")).to_have_count(0)

    go(page, "Usage")
    expect(page.get_by_label("Tenant", exact=True).locator("option")).to_have_text(["All tenants", mine])

    go(page, "Audit")
    expect(page.get_by_role("table")).to_be_visible()
    audit_text = page.get_by_role("table").inner_text()
    assert ids[mine] in audit_text
    assert ids[theirs] not in audit_text and their_key["id"] not in audit_text
    assert theirs not in audit_text

    go(page, "Engines")
    expect(page.get_by_role("alert")).to_contain_text("platform admin")


def test_every_page_renders(page: Page, stack: RunningStack) -> None:
    """Each page loads without a script error or CSP violation (the fixture checks), with its nav
    link marked current. Saves screenshots when TERN_CONSOLE_SCREENSHOTS names a folder."""
    shots = os.environ.get("TERN_CONSOLE_SCREENSHOTS")
    page.goto("/")
    expect(page.get_by_label("Admin key")).to_be_visible()
    if shots:
        page.screenshot(path=f"{shots}/console-sign-in.png")
    sign_in(page, stack.admin_key)
    for name in NAV:
        go(page, name)
        link = page.get_by_role("navigation").get_by_role("link", name=name, exact=True)
        expect(link).to_have_attribute("aria-current", "page")
        expect(page.get_by_role("heading", level=1)).to_contain_text(name.rstrip("s"))
        expect(page.get_by_role("alert")).to_have_count(0)
        if name == "Engines":  # the real engine's own metrics, read through the gateway
            expect(page.get_by_role("row").filter(has_text="healthy")).to_contain_text("blocks")
        if name == "Playground":
            page.get_by_role("button", name="Create inference key").click()
            expect(page.get_by_text("model(s) available")).to_be_visible()
            page.get_by_label("System prompt").fill("Answer in one short sentence.")
            page.get_by_label("Max tokens").fill("24")
            page.get_by_label("Message").fill("What is the capital of France?")
            page.get_by_role("button", name="Send").click()
            expect(page.locator(".bubble.assistant .stats")).to_be_visible(timeout=ANSWER_TIMEOUT_MS)
        page.wait_for_load_state("networkidle")
        if shots:
            page.screenshot(path=f"{shots}/console-{name.lower()}.png", full_page=False)


def test_limits_and_prices_show_api_errors_next_to_their_fields(
    page: Page, stack: RunningStack, admin: httpx.Client
) -> None:
    sign_in(page, stack.admin_key)
    tenant = f"limits-{uuid.uuid4().hex[:6]}"
    create_tenant(page, tenant)
    tenant_id = next(t["id"] for t in admin.get("/admin/tenants").json()["data"] if t["name"] == tenant)
    go(page, "Limits")
    page.get_by_label("Tenant", exact=True).select_option(label=tenant)
    limits = page.get_by_role("form", name="Tenant limits")
    limits.get_by_label("Requests per minute").fill("100")
    limits.get_by_label("Per-model limits (JSON)").fill('{"some-model": {"rpm_limit": -1}}')
    limits.get_by_role("button", name="Save tenant limits").click()
    expect(limits.locator('[data-error-for="model_limits"]')).to_contain_text("rpm_limit")
    assert admin.get(f"/admin/limits/tenants/{tenant_id}").json()["rpm_limit"] is None  # nothing saved

    # The old name ("rpm"), still accepted, saved under the new one.
    limits.get_by_label("Per-model limits (JSON)").fill('{"some-model": {"rpm": 10}}')
    limits.get_by_role("button", name="Save tenant limits").click()
    expect(limits.get_by_role("status")).to_have_text("Saved.")
    saved = admin.get(f"/admin/limits/tenants/{tenant_id}").json()
    assert saved["rpm_limit"] == 100 and saved["model_limits"]["some-model"]["rpm_limit"] == 10

    prices = page.get_by_role("form", name="Add price")
    prices.get_by_label("Model", exact=True).fill("console-model")
    prices.get_by_label("Prompt price per 1M tokens", exact=True).fill("lots")
    prices.get_by_label("Completion price per 1M tokens").fill("2")
    prices.get_by_role("button", name="Add price").click()
    expect(prices.locator('[data-error-for="prompt_per_mtok"]')).not_to_be_empty()
    prices.get_by_label("Prompt price per 1M tokens", exact=True).fill("0.5")
    prices.get_by_role("button", name="Add price").click()
    expect(row(page, "console-model")).to_contain_text("0.5")


def test_api_docs_render_the_openapi_document(page: Page, stack: RunningStack) -> None:
    """/docs: Swagger UI (vendored, under the console's CSP) showing the whole API, the direct-lane
    generation routes included, with an Authorize button for a bearer key (issue 18, defect 5)."""
    page.goto("/docs")
    expect(page).to_have_url(f"{stack.url}/ui/docs/")
    for path in ("/v1/chat/completions", "/v1/completions", "/admin/tenants", "/admin/keys/{key_id}/revoke"):
        expect(page.get_by_text(path, exact=True).first).to_be_visible()
    expect(page.get_by_role("button", name="Authorize")).to_be_visible()
