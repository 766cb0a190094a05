"""What a domain service raises when it refuses: the kind of refusal, in the domain's words.

Services know nothing of HTTP. The API maps these kinds to statuses and OpenAI-shaped bodies
(``gateway.errors``); the ``tern admin`` command prints their message. Each domain names its own
refusals in its ``exceptions.py`` as subclasses of these kinds.
"""

from __future__ import annotations


class DomainError(Exception):
    """A refusal with a message for the caller, the field it concerns and a stable code."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidInput(DomainError):
    """The request asks for something that cannot be (400)."""


class Forbidden(DomainError):
    """The actor may not do this (403)."""


class NotFound(DomainError):
    """No such object that the actor may see (404: other tenants' objects are not revealed)."""


class Conflict(DomainError):
    """The object's current state forbids it (409)."""


class PlatformAdminRequired(Forbidden):
    def __init__(self, action: str) -> None:
        super().__init__(f"Only a platform admin key can {action}.", code="platform_admin_required")
