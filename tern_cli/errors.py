"""Every ``tern`` failure as one line on stderr, never a traceback.

An operator who mistyped a flag or forgot to start the stack needs to know what is wrong and what
to do next; a hundred lines of asyncpg internals tell them neither. ``TERN_DEBUG=1`` re-raises, for
the rare bug report that needs the traceback.
"""

from __future__ import annotations

import os
from typing import Any
from urllib.parse import urlsplit

DEBUG_ENV = "TERN_DEBUG"
START_THE_STACK = "start the local stack with `make up` (or pass --data-dir DIR), or set TERN_DATABASE_URL"


class CliError(Exception):
    """A failure whose message is already the line to print."""


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def database_host(database_url: str) -> str:
    """``host:port/db`` of a database URL, without the user or password."""
    parts = urlsplit(database_url)
    return f"{parts.hostname or 'localhost'}:{parts.port or 5432}{parts.path}"


def database_problem(exc: BaseException, database_url: str) -> str | None:
    """The line for a database failure, or None if ``exc`` is not one."""
    from sqlalchemy.exc import DBAPIError

    where = database_host(database_url)
    if isinstance(exc, DBAPIError):
        reason = first_line(str(exc.orig))
        if "does not exist" in reason and "relation" in reason:
            return f"the database at {where} has no Tern schema ({reason}); run `tern migrate`"
        if "database" in reason and "does not exist" in reason:
            return f"cannot use the database at {where}: {reason}"
        return f"database error at {where}: {reason}"
    if isinstance(exc, OSError | TimeoutError):
        reason = first_line(str(exc)) or type(exc).__name__
        return f"cannot reach the database at {where} ({reason}); {START_THE_STACK}"
    return None


def settings_problem(exc: Any) -> str:
    """The line for invalid ``TERN_*`` settings (a pydantic ``ValidationError``)."""
    problems = []
    for error in exc.errors():
        name = "TERN_" + "_".join(str(part) for part in error["loc"]).upper()
        message = str(error["msg"]).removeprefix("Value error, ")
        problems.append(message if name in message else f"{name}: {message}")
    return "invalid settings: " + "; ".join(problems)


def describe(exc: BaseException, *, database_url: str | None = None) -> str:
    """One line saying what went wrong."""
    from pydantic import ValidationError

    if isinstance(exc, CliError):
        return str(exc)
    message = getattr(exc, "message", None)
    if isinstance(message, str) and message:  # a service's refusal (gateway.exceptions.DomainError)
        return message
    if isinstance(exc, ValidationError):
        return settings_problem(exc)
    if database_url is not None:
        problem = database_problem(exc, database_url)
        if problem is not None:
            return problem
    text = first_line(str(exc))
    if isinstance(exc, RuntimeError) and text:
        return text  # our own failures: the message is written for the user
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
