"""Restarting a crashed child (an engine, the gateway) with backoff, so one crash does not take the
whole stack down.

``tern up`` calls :meth:`Restarter.poll` from its main loop (every half second); nothing here blocks,
so Ctrl-C stays prompt while a restart is pending. The delay doubles with each crash (1 s, 2 s,
4 s, ... at most 30 s) so a child that dies at once on every start does not spin, and resets once a
start has stayed up for a minute. Meanwhile the gateway takes a missing engine out of its rotation
and answers ``503 engine_unavailable``; a restarted gateway replays its predecessor's usage journal.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from tern_stack.processes import Child


@dataclass(frozen=True)
class Backoff:
    first_delay_s: float = 1.0
    max_delay_s: float = 30.0
    stable_after_s: float = 60.0
    """A start that lived this long was not a crash loop: the next delay is the first again."""

    def delay_s(self, crashes_in_a_row: int) -> float:
        return min(self.first_delay_s * 2 ** (crashes_in_a_row - 1), self.max_delay_s)


def describe_exit(code: int) -> str:
    """``exited with code 1`` or ``was killed by SIGKILL``."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class Restarter:
    """Watches one child; when it exits, announces it and starts it again after the backoff delay."""

    def __init__(
        self,
        child: Child,
        *,
        start: Callable[[Child], None],
        backoff: Backoff = Backoff(),
        say: Callable[[str], None] = lambda line: print(line, flush=True),
    ) -> None:
        self.child = child
        self._start = start
        self.backoff = backoff
        self._say = say
        self.crashes_in_a_row = 0
        self.restarts = 0
        self._started_at = time.monotonic()
        self._due_at: float | None = None

    @property
    def pending(self) -> bool:
        """A crash was seen and the restart has not happened yet."""
        return self._due_at is not None

    def poll(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._due_at is None:
            code = self.child.exited()
            if code is None:
                return
            if now - self._started_at >= self.backoff.stable_after_s:
                self.crashes_in_a_row = 0
            self.crashes_in_a_row += 1
            delay = self.backoff.delay_s(self.crashes_in_a_row)
            self._due_at = now + delay
            self._say(
                f"The {self.child.name} {describe_exit(code)}; restarting it in {delay:.0f} s "
                f"(crash {self.crashes_in_a_row} in a row; log {self.child.log_path})"
            )
        elif now >= self._due_at:
            self._due_at = None
            self._start(self.child)
            self.restarts += 1
            self._started_at = time.monotonic()
            self._say(f"The {self.child.name} restarted (pid {self.child.pid})")
