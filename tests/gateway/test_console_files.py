"""The console's files: served under /ui/ with strict security headers, ``/`` redirecting there.

What the console does is tested in a real browser (tests/e2e/test_console.py).
"""

from __future__ import annotations

import hashlib
import re

import httpx
import pytest

from gateway.console.router import STATIC_DIR

pytestmark = pytest.mark.anyio


async def test_root_redirects_to_the_console(client: httpx.AsyncClient) -> None:
    response = await client.get("/")
    assert response.status_code == 307
    assert response.headers["location"] == "/ui/"


async def test_console_page_has_security_headers(client: httpx.AsyncClient) -> None:
    response = await client.get("/ui/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert 'src="js/main.js"' in response.text
    csp = response.headers["content-security-policy"]
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["script-src"] == "'self'"
    assert "unsafe-inline" not in csp and "http" not in csp
    assert directives["frame-ancestors"] == "'none'"
    assert response.headers["x-frame-options"] == "DENY"
    assert response.headers["x-content-type-options"] == "nosniff"


async def test_every_module_is_served_as_javascript(client: httpx.AsyncClient) -> None:
    modules = sorted(STATIC_DIR.glob("js/**/*.js"))
    assert modules
    for path in modules:
        response = await client.get(f"/ui/{path.relative_to(STATIC_DIR)}")
        assert response.status_code == 200, path
        assert "javascript" in response.headers["content-type"]
        assert response.headers["x-frame-options"] == "DENY"


SWAGGER_UI = STATIC_DIR / "docs" / "swagger-ui-5.32.0"
SWAGGER_UI_SHA256 = {  # npm swagger-ui-dist@5.32.0, unmodified
    "swagger-ui-bundle.js": "d9bbb469128e88a974c78e76457c3910babb4649447d901af19a60335a09ee1e",
    "swagger-ui.css": "b024df29b02b4943bf95cb835fce9d19d4559c14e374b0dd36a89b27a223a2da",
}


def test_no_inline_scripts_or_styles_and_no_other_origins() -> None:
    for page in (STATIC_DIR / "index.html", STATIC_DIR / "docs" / "index.html"):
        html = page.read_text()
        assert not re.search(r"<script(?![^>]*\bsrc=)", html)
        assert " style=" not in html and "<style" not in html
    for path in STATIC_DIR.rglob("*"):
        # The vendored Swagger UI names URLs in its text (licences, JSON Schema ids); the CSP keeps it
        # from loading anything (connect-src 'self'), which the browser test checks.
        if path.is_file() and SWAGGER_UI not in path.parents:
            assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", path.read_text()), path


def test_vendored_swagger_ui_is_the_pinned_release() -> None:
    for name, digest in SWAGGER_UI_SHA256.items():
        assert hashlib.sha256((SWAGGER_UI / name).read_bytes()).hexdigest() == digest, name


async def test_unknown_console_file_is_404_and_no_escape(client: httpx.AsyncClient) -> None:
    assert (await client.get("/ui/nope.js")).status_code == 404
    assert (await client.get("/ui/../../pyproject.toml")).status_code == 404
