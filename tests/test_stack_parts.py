"""The pieces of ``tern up`` that need no model: secrets kept under .tern/, the orphan watchdog, restarts."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from gateway.keys.format import has_valid_checksum
from tern_stack.cli import build_parser
from tern_stack.processes import Child
from tern_stack.restarts import Backoff, Restarter, describe_exit
from tern_stack.run_file import RunInfo, read_run_info
from tern_stack.state import StateDir


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it is dead for our purposes.
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


def _wait_until_dead(pid: int, deadline_s: float = 30.0) -> bool:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_secrets_are_generated_once_private_and_reused(tmp_path: Path) -> None:
    state = StateDir(tmp_path / ".tern")
    state.prepare()
    first = state.secret("secret", lambda: "generated-value")
    again = state.secret("secret", lambda: "a different value")
    assert first == again == "generated-value"
    assert stat.S_IMODE((state.root / "secret").stat().st_mode) == 0o600
    # PostgreSQL's unprivileged account must be able to pass through .tern/ to its data dir.
    assert stat.S_IMODE(state.root.stat().st_mode) & 0o001


def test_run_info_is_renamed_into_place_never_rewritten_in_place(tmp_path: Path) -> None:
    """Tests and tools wait for run.json to appear and read it at once: it must never be half written.
    A reader that opened the old file still reads it whole after a rewrite (a new file took its name)."""
    state = StateDir(tmp_path / ".tern")
    state.prepare()
    state.write_run_info(RunInfo(gateway_url="http://old"))
    with state.run_file.open() as reader:
        state.write_run_info(RunInfo(gateway_url="http://new", pids={"engine": 7}))
        assert json.loads(reader.read())["gateway_url"] == "http://old"
    assert read_run_info(state.root) == RunInfo(gateway_url="http://new", pids={"engine": 7})
    assert sorted(p.name for p in state.root.iterdir()) == ["logs", "run.json"]


def test_generated_admin_key_is_a_valid_tern_admin_key(tmp_path: Path) -> None:
    from gateway.keys.format import generate_key

    state = StateDir(tmp_path / ".tern")
    state.prepare()
    key = state.secret("admin_key", lambda: generate_key("admin"))
    assert key.startswith("tern_ak_") and has_valid_checksum(key)


def test_port_defaults_to_8000_and_follows_tern_gateway_port(monkeypatch) -> None:
    monkeypatch.delenv("TERN_GATEWAY_PORT", raising=False)
    assert build_parser().parse_args([]).port == 8000
    monkeypatch.setenv("TERN_GATEWAY_PORT", "9123")
    args = build_parser().parse_args(["--model", "/m.gguf", "--device", "cpu"])
    assert (args.port, args.model, args.device) == (9123, "/m.gguf", "cpu")


def test_watchdog_stops_children_when_tern_up_is_killed(tmp_path: Path) -> None:
    """SIGKILL leaves no chance to clean up; the watchdog must stop the child process group."""
    pid_file = tmp_path / "child.pid"
    parent_code = textwrap.dedent(
        f"""
        import signal, subprocess, sys, time
        from tern_stack.processes import Watchdog
        watchdog = Watchdog()
        child = subprocess.Popen(["sleep", "600"], start_new_session=True)
        watchdog.watch(signal.SIGTERM, -child.pid)
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(600)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_code])
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert parent.poll() is None, "the stand-in for tern up died early"
            assert time.monotonic() < deadline
            time.sleep(0.05)
        child_pid = int(pid_file.read_text())
        assert _alive(child_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        assert _wait_until_dead(child_pid), "the child outlived tern up"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_watchdog_leaves_children_alone_after_a_clean_shutdown(tmp_path: Path) -> None:
    from tern_stack.processes import Watchdog

    child = subprocess.Popen(["sleep", "600"], start_new_session=True)
    try:
        watchdog = Watchdog()
        watchdog.watch(signal.SIGTERM, -child.pid)
        watchdog.close()  # what tern up does after stopping everything itself
        assert child.poll() is None
    finally:
        child.kill()
        child.wait()


def test_a_stop_signal_inside_a_deferred_section_is_raised_when_it_ends() -> None:
    """Ctrl-C while a server starts must not skip registering that server for cleanup."""
    from tern_stack.processes import StopRequested, StopSignals

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    steps = []
    try:
        with StopSignals() as signals, pytest.raises(StopRequested, match="SIGTERM"):
            with signals.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                steps.append("registered for cleanup")
            steps.append("went on after the signal")
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert steps == ["registered for cleanup"]


def test_a_crashed_child_is_restarted_with_doubling_backoff(tmp_path: Path) -> None:
    """A real child that dies at once on every start: restarted after 1 s, 2 s, 4 s ... never spinning."""
    child = Child(
        "engine", [sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ), tmp_path / "e.log"
    )
    lines: list[str] = []
    restarter = Restarter(child.start(), start=lambda c: c.restart(), say=lines.append)
    child.process.wait()  # type: ignore[union-attr]
    now = time.monotonic()
    for crash, delay in enumerate([1, 2, 4], start=1):
        restarter.poll(now)
        assert restarter.pending and f"exited with code 3; restarting it in {delay} s" in lines[-1]
        assert f"crash {crash} in a row" in lines[-1]
        restarter.poll(now + delay - 0.01)
        assert restarter.pending, "not before its time"
        now += delay
        restarter.poll(now)
        assert not restarter.pending and restarter.restarts == crash
        child.process.wait()  # type: ignore[union-attr]
    assert Backoff().delay_s(10) == 30.0, "capped"
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
