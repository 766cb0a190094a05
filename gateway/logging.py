"""JSON logs, one object per line, each carrying the current request id."""

from __future__ import annotations

import logging
import sys
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any

import orjson

request_id_var: ContextVar[str | None] = ContextVar("tern_request_id", default=None)

_STANDARD_ATTRS = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}
_NOT_FOR_JSON = {"color_message"}
"""uvicorn's copy of a message with ANSI colour codes, meant for terminals: never in a JSON line."""
_NOT_EXTRA = frozenset(_STANDARD_ATTRS | _NOT_FOR_JSON)


class _SecondStamp:
    """``YYYY-MM-DDTHH:MM:SS`` of the last second formatted: the access log writes a line per request,
    and the date formatting was a third of the formatter's time; only the milliseconds change."""

    second = -1
    text = ""

    @classmethod
    def of(cls, created: float, msecs: float) -> str:
        second = int(created)
        if second != cls.second:
            cls.text = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
            cls.second = second
        return f"{cls.text}.{int(msecs):03d}+00:00"


class JsonFormatter(logging.Formatter):
    """Fields passed with ``extra=`` become top-level keys."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _SecondStamp.of(record.created, record.msecs),  # isoformat(timespec="milliseconds")
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or request_id_var.get()
        if request_id is not None:
            entry["request_id"] = request_id
        for name, value in record.__dict__.items():
            if name not in _NOT_EXTRA and name[0] != "_":
                entry[name] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(level: str = "INFO", *, json: bool = True) -> None:
    # Neither format shows the thread, process or source line, so skip collecting them for every
    # record (the logging HOWTO's "Optimization" section): the access log writes one per request.
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    logging._srcfile = None
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if json else logging.Formatter("%(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # Our access log replaces uvicorn's.
    logging.getLogger("uvicorn.access").disabled = True
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
