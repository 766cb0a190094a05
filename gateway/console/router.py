"""The web console: static files under ``/ui/`` and ``/`` redirecting there; ``/docs``, the API docs.

The console is a few ES modules that call the public admin and ``/v1`` APIs with the key the user
signs in with; the server only hands out files. Every file goes out with a strict
Content-Security-Policy (no inline scripts, no other origins) and may not be framed.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import RedirectResponse
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

STATIC_DIR = Path(__file__).parent / "static"

SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}

router = APIRouter(include_in_schema=False)


@router.get("/")
async def root() -> RedirectResponse:
    return RedirectResponse("/ui/", status_code=307)


@router.get("/docs")
async def api_docs() -> RedirectResponse:
    """Interactive docs for /openapi.json: Swagger UI, vendored under static/docs/ (no CDN)."""
    return RedirectResponse("/ui/docs/", status_code=307)


class ConsoleFiles(StaticFiles):
    """StaticFiles with the console's security headers on every answer."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers.update(SECURITY_HEADERS)
        return response


def include_console(app: FastAPI) -> None:
    app.include_router(router)
    app.mount("/ui", ConsoleFiles(directory=STATIC_DIR, html=True), name="console")
