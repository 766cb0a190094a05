"""The stand-in engine the gateway's benchmarks run against: protocol/rpc.py, answered at once.

Raw ASGI under uvicorn, so that what a benchmark measures is the gateway (or the HTTP client), not
the stand-in. A generation answers ``sampling.max_tokens`` delta frames (default 1) and the final
frame; ``/rpc/v1/health`` and ``/rpc/v1/models`` answer as an engine does; any other path answers
``{"aborted": false}`` (the abort call). The gateway's tests use ``tests/gateway/fake_engine.py``
instead, which adds failure switches and records what it received.

``python -m bench.gateway.standin PORT`` serves it; :func:`start_standin` does so in a child process.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from functools import cache
from typing import Any

import orjson

from protocol.rpc import (
    GENERATE_PATH,
    HEALTH_PATH,
    MODELS_PATH,
    DeltaFrame,
    FinalFrame,
    HealthResponse,
    ModelInfo,
    ModelList,
    encode_frame,
)

MODEL = "standin"
DELTA = encode_frame(DeltaFrame(text="ok", token_ids=[1]))
JSON = b"application/json"
NDJSON = b"application/x-ndjson"


@cache
def _final(tokens: int) -> bytes:
    return encode_frame(FinalFrame(finish_reason="length", prompt_tokens=1, completion_tokens=tokens))


async def standin_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    path = scope["path"]
    if path == GENERATE_PATH:
        sampling = orjson.loads(b"".join(chunks)).get("sampling") or {}
        tokens = sampling.get("max_tokens") or 1
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", NDJSON)]})
        for _ in range(tokens):
            await send({"type": "http.response.body", "body": DELTA, "more_body": True})
        await send({"type": "http.response.body", "body": _final(tokens)})
        return
    if path == HEALTH_PATH:
        body = HealthResponse(status="ok", model=MODEL).model_dump_json().encode()
    elif path == MODELS_PATH:
        # Listed as today's engines list it; its prompts are 1 token, within any max_prompt_tokens.
        body = ModelList(data=[ModelInfo(id=MODEL, prompt_overhead=0)]).model_dump_json().encode()
    else:
        body = b'{"aborted": false}'
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", JSON)]})
    await send({"type": "http.response.body", "body": body})


def start_standin(port: int, *, timeout_s: float = 30.0) -> subprocess.Popen[bytes]:
    """Serve the stand-in on 127.0.0.1:``port`` in a child process; return once it accepts connections."""
    process = subprocess.Popen([sys.executable, "-m", "bench.gateway.standin", str(port)])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the stand-in engine exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the stand-in engine did not start")


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(
        standin_app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        log_level="warning",
        access_log=False,
        lifespan="off",
    )
