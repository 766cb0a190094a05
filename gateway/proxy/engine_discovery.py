"""Engines found by DNS: a ``dns+`` entry in ``TERN_ENGINE_URLS`` names a headless Service, whose
name resolves to one address per engine pod; the gateway routes to each address as its own engine.

``dns+http://tern-engine.tern.svc:8100`` (``tern+dns+http://`` and ``openai+dns+http://`` too) is
resolved when the pool starts and again before every health round, so engines that a
``kubectl scale`` (or an autoscaler) adds join the rotation within one probe interval and engines that
go away leave it, with no Helm upgrade and no gateway restart (docs/operations.md). A failed lookup
keeps the addresses last found: a DNS hiccup must not empty the pool.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from urllib.parse import urlsplit, urlunsplit

from gateway.config import EngineSpec

log = logging.getLogger(__name__)

Resolver = Callable[[str], Awaitable[list[str]]]
"""A host name -> its addresses (every A/AAAA record)."""


async def resolve_host(host: str) -> list[str]:
    """The system resolver, off the event loop (getaddrinfo in the loop's executor)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def at_address(spec: EngineSpec, address: str) -> EngineSpec:
    """``spec`` with its host replaced by ``address`` (an IPv6 one bracketed), port and path kept."""
    parts = urlsplit(spec.url)
    host = f"[{address}]" if ":" in address else address
    netloc = f"{host}:{parts.port}" if parts.port else host
    return replace(spec, url=urlunsplit(parts._replace(netloc=netloc)), discover=False)


class EngineDiscovery:
    """The engines ``specs`` stand for now: static entries as they are, ``dns+`` ones resolved."""

    def __init__(self, specs: Sequence[EngineSpec], resolver: Resolver = resolve_host) -> None:
        self.specs = list(specs)
        self._resolver = resolver
        self._last: dict[str, list[str]] = {}
        """Per ``dns+`` entry, the addresses of the last lookup that answered."""

    @property
    def dynamic(self) -> bool:
        return any(spec.discover for spec in self.specs)

    async def engines(self) -> list[EngineSpec]:
        """Every engine, in entry order, each address once per entry (duplicates dropped)."""
        found: list[EngineSpec] = []
        for spec in self.specs:
            if not spec.discover:
                found.append(spec)
                continue
            found.extend(at_address(spec, address) for address in await self._addresses(spec))
        unique: dict[str, EngineSpec] = {}
        for spec in found:
            unique.setdefault(spec.url, spec)
        return list(unique.values())

    async def _addresses(self, spec: EngineSpec) -> list[str]:
        host = urlsplit(spec.url).hostname or ""
        try:
            addresses = await self._resolver(host)
        except (OSError, UnicodeError) as exc:  # socket.gaierror is an OSError
            log.warning("engine discovery: %s did not resolve (%s); keeping the last answer", host, exc)
            return self._last.get(spec.url, [])
        previous = self._last.get(spec.url)
        if previous is not None and sorted(previous) != sorted(addresses):
            log.info("engine discovery: %s now has %d engines (was %d)", host, len(addresses), len(previous))
        self._last[spec.url] = addresses
        return addresses
