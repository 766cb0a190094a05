"""``tern bench journal-sync``: how long a usage journal batch waits for its sync, per syncer.

The gateway answers a request only once its usage line is synced, so in a closed loop (the
clients of ``tern bench gateway``) this wait is part of every answer's latency. For each syncer of
``gateway.usage.journal_sync`` (a child process, the thread), in turns: append a batch
the size of a busy gateway's (16 lines of 300 bytes), sync it, wait ``--gap-ms``, ``--syncs``
times; once with the event loop otherwise idle and once beside a busy loop (short Python steps
that never block, as a saturated gateway's loop). Reports the sync's wait (p50, p90, ms), the event
loop's CPU to start one (us) and, with the busy loop, its steps a second (the syncer's cost to the
loop's progress). Where the sync runs depends on what else the machine runs: compare on an idle one.

    tern bench journal-sync --syncs 300
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gateway.usage.journal_sync import SyncerKind, make_syncer

BATCH = b"x" * 300 * 16


def _busy_step() -> int:
    total = 0
    for i in range(1000):
        total += i * i
    return total


async def measure(
    kind: SyncerKind, directory: Path, *, syncs: int, gap_s: float, busy: bool
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    syncer = make_syncer(loop, kind)
    fd = os.open(directory / f"{kind}.journal", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o600)
    waits: list[float] = []
    submit_cpu = 0.0
    steps = 0
    running = True

    async def keep_busy() -> None:
        nonlocal steps
        while running:
            _busy_step()
            steps += 1
            await asyncio.sleep(0)

    busy_task = loop.create_task(keep_busy()) if busy else None
    started_run = time.perf_counter()
    try:
        await asyncio.sleep(0.2)  # a child process starts
        for _ in range(syncs):
            os.write(fd, BATCH)
            synced: asyncio.Future[BaseException | None] = loop.create_future()
            cpu_before, started = time.thread_time(), time.perf_counter()
            syncer.sync((fd,), synced.set_result)
            submit_cpu += time.thread_time() - cpu_before
            error = await synced
            waits.append(time.perf_counter() - started)
            if error is not None:
                raise error
            await asyncio.sleep(gap_s)
    finally:
        elapsed = time.perf_counter() - started_run
        running = False
        if busy_task is not None:
            await busy_task
        syncer.stop()
        os.close(fd)
    waits.sort()
    return {
        "syncer": type(syncer).__name__,
        "busy_loop": busy,
        "wait_p50_ms": round(waits[len(waits) // 2] * 1000, 3),
        "wait_p90_ms": round(waits[len(waits) * 9 // 10] * 1000, 3),
        "start_cpu_us": round(submit_cpu / syncs * 1e6, 1),
        **({"busy_steps_per_s": round(steps / elapsed)} if busy else {}),
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


async def run(*, syncs: int, gap_s: float, rounds: int) -> dict[str, Any]:
    kinds: list[SyncerKind] = ["process", "thread"]
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tern-journal-sync-", dir=".") as directory:
        for round_index in range(rounds):
            for kind in kinds if round_index % 2 == 0 else reversed(kinds):
                for busy in (False, True):
                    result = await measure(kind, Path(directory), syncs=syncs, gap_s=gap_s, busy=busy)
                    runs.append({"round": round_index, "kind": kind, **result})
                    print(json.dumps(runs[-1]), file=sys.stderr)
    return {
        "benchmark": "journal_sync",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "syncs_per_run": syncs,
        "gap_ms": gap_s * 1000,
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tern bench journal-sync", description=__doc__.splitlines()[0])
    parser.add_argument("--syncs", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    print(
        json.dumps(asyncio.run(run(syncs=args.syncs, gap_s=args.gap_ms / 1000, rounds=args.rounds)), indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
