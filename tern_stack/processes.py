"""The processes ``tern up`` runs: children in their own sessions, the orphan watchdog, stop signals.

Every child gets its own session (process group), so a terminal's Ctrl-C reaches only ``tern up``,
which then stops the children in order. A small watchdog process holds a pipe to us; if we die
without cleaning up (SIGKILL, OOM killer), the pipe closes and the watchdog stops the children.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

STOP_TIMEOUT_S = 20.0


class StopRequested(Exception):
    """SIGINT or SIGTERM arrived."""


def tern_command() -> list[str]:
    """How to run another ``tern`` subcommand with this same interpreter and install."""
    return [sys.executable, "-m", "tern_cli"]


@dataclass
class Child:
    """A ``tern`` subcommand running in its own process group, output to a log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> Child:
        with self.log_path.open("ab") as log:
            log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(self.argv)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def restart(self) -> Child:
        """Start it again after it exited; whatever is left of the old process group goes first."""
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
        return self.start()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def exited(self) -> int | None:
        """The exit code, or None while it runs."""
        return None if self.process is None else self.process.poll()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM to the whole group, then SIGKILL to whatever is left after the grace period."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            print(f"  {self.name} did not stop within {timeout_s:.0f} s; killing it", flush=True)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)  # stragglers in the group (workers), if any
        self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class Watchdog:
    """Stops the children if this process dies without doing so itself.

    It runs in its own session and reads lines ``SIGNAL PID`` (negative PID: a process group) from a
    pipe. ``done`` means a clean shutdown happened; end of file without it means we died, and it
    delivers every registered signal in reverse order, then SIGKILLs the groups still alive.
    """

    def __init__(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", "from tern_stack.processes import run_watchdog; run_watchdog()"],
            stdin=subprocess.PIPE,
            start_new_session=True,
        )
        assert self._process.stdin is not None
        self._pipe: IO[bytes] = self._process.stdin

    @property
    def pid(self) -> int:
        return self._process.pid

    def watch(self, sig: signal.Signals, pid: int) -> None:
        self._pipe.write(f"{sig.name} {pid}\n".encode())
        self._pipe.flush()

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):
            self._pipe.write(b"done\n")
            self._pipe.close()
        self._process.wait(timeout=10)


def run_watchdog() -> None:
    """The watchdog's main loop (see :class:`Watchdog`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    targets: list[tuple[signal.Signals, int]] = []
    for line in sys.stdin:
        if line.strip() == "done":
            return
        name, pid = line.split()
        targets.append((signal.Signals[f"SIG{name.removeprefix('SIG')}"], int(pid)))
    for sig, pid in reversed(targets):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
    time.sleep(STOP_TIMEOUT_S / 2)
    for _, pid in targets:
        if pid < 0:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(-pid, signal.SIGKILL)


class StopSignals:
    """SIGINT and SIGTERM raise :class:`StopRequested`, except inside :meth:`deferred` sections.

    A process started inside a deferred section is always registered for cleanup before the stop
    request is raised, so an early Ctrl-C cannot leave a server running. Once the ``with`` block
    ends (cleanup time), both signals are ignored.
    """

    def __init__(self) -> None:
        self._depth = 0
        self._pending: str | None = None

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self._depth:
            self._pending = name
            return
        raise StopRequested(name)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        except Exception:
            if self._pending:  # a terminal's Ctrl-C also reaches the tools we ran (initdb, pg_ctl)
                raise StopRequested(self._pending) from None
            raise
        finally:
            self._depth -= 1
        if not self._depth and self._pending:
            raise StopRequested(self._pending)

    def __enter__(self) -> StopSignals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)


def announce_and_call(message: str, stop: Callable[[], None]) -> None:
    """A cleanup step that says what it stops first."""
    print(f"  {message}", flush=True)
    stop()
