"""The errors the engine refuses a request with, below every package that raises them (the core,
structured output, serving), so none of them imports another for an exception."""

from __future__ import annotations

import enum


class ErrorKind(enum.Enum):
    """Why a request is refused; the value is the error code clients see (the server maps it to a status)."""

    INVALID_REQUEST = "invalid_request"
    MODEL_NOT_FOUND = "model_not_found"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    CONFLICT = "conflict"
    PROMPT_OVER_RESERVATION = "prompt_over_reservation"


class RequestError(ValueError):
    """A request the engine refuses before doing any work."""

    def __init__(
        self, message: str, *, kind: ErrorKind = ErrorKind.INVALID_REQUEST, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.param = param
        self.prompt_tokens: int | None = None
        """For ``PROMPT_OVER_RESERVATION``: the prompt's exact token count."""

    @property
    def code(self) -> str:
        return self.kind.value
