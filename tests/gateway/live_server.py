"""Run an ASGI app on a real port in a background thread, for tests that need real HTTP.

Streaming and client disconnects only behave for real over a socket (httpx's
ASGI transport buffers whole responses), so the proxy tests, the fake engine
and the openai-client tests all serve through this.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Awaitable
from typing import Any, Self, TypeVar

import httpx
import uvicorn

from tern_stack.services import free_port

__all__ = ["ServedApp", "ServerThread", "create_inference_key", "free_port"]

T = TypeVar("T")


class ServerThread:
    """uvicorn on 127.0.0.1 in a daemon thread with its own event loop."""

    def __init__(
        self, app: Any, *, port: int | None = None, lifespan: str = "on", host: str = "127.0.0.1"
    ) -> None:
        self.port = port or free_port()
        self.host = host
        config = uvicorn.Config(app, host=host, port=self.port, log_level="warning", lifespan=lifespan)
        self.server = uvicorn.Server(config)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=f"server-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def call(self, awaitable: Awaitable[T], timeout: float = 30) -> T:
        """Run a coroutine on the server's loop (for objects that live there) and wait for it."""
        return asyncio.run_coroutine_threadsafe(awaitable, self.loop).result(timeout)  # type: ignore[arg-type]

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=15)


class ServedApp:
    """A stand-in server's lifecycle: serve ``self.app`` on ``self.port`` in a thread; stopping opens
    ``self.gate`` (if any) first, so no handler waits on it forever."""

    app: Any
    port: int
    gate: threading.Event | None
    _server: ServerThread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        self._server = ServerThread(self.app, port=self.port, lifespan="off").start()
        return self

    def stop(self) -> None:
        if self.gate is not None:
            self.gate.set()
        if self._server is not None:
            self._server.stop()


def create_inference_key(base_url: str, admin_key: str, **key_fields: Any) -> str:
    """A new tenant and an inference key for it, through the live gateway's admin API; returns the secret."""
    admin = {"Authorization": f"Bearer {admin_key}"}
    with httpx.Client(base_url=base_url, timeout=30, headers=admin) as client:
        tenant = client.post("/admin/tenants", json={"name": f"tenant-{uuid.uuid4().hex[:12]}"})
        assert tenant.status_code == 201, tenant.text
        body = {"tenant_id": tenant.json()["id"], "name": "key", "kind": "inference", **key_fields}
        created = client.post("/admin/keys", json=body)
        assert created.status_code == 201, created.text
        return created.json()["key"]
