"""How long ``make up`` takes to serve: from a fresh clone (installs included), then once installed.

    python3 deploy/time_make_up.py [--clone-dir /tmp/tern-timing] [--port 8000]

Clones this repository's HEAD, runs ``make up``, polls ``/readyz`` until 200, stops it the way a
terminal's Ctrl-C does (SIGINT to the process group), then starts it a second time. Prints one JSON
object. Standard library only, so it runs before any install.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READY_LIMIT_S = 900.0


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def time_one_start(clone: Path, port: int, log_path: Path) -> dict[str, object]:
    started = time.monotonic()
    env = {**os.environ, "TERN_GATEWAY_PORT": str(port)}
    with log_path.open("wb") as log:
        make = subprocess.Popen(
            ["make", "up"], cwd=clone, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        while not _ready(f"http://127.0.0.1:{port}/readyz"):
            if make.poll() is not None or time.monotonic() - started > READY_LIMIT_S:
                raise RuntimeError(f"make up did not get ready; see {log_path}")
            time.sleep(0.5)
        ready_s = time.monotonic() - started
        while b"Ready in" not in log_path.read_bytes():  # the welcome banner with the keys
            time.sleep(0.2)
        timings = {"readyz_200_s": round(ready_s, 1), "banner_s": round(time.monotonic() - started, 1)}
    finally:
        os.killpg(make.pid, signal.SIGINT)
        exit_status = make.wait(timeout=120)
    return {**timings, "exit_status_after_ctrl_c": exit_status}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clone-dir", type=Path, default=Path("/tmp/tern-timing"))
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()

    shutil.rmtree(args.clone_dir, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(REPO), str(args.clone_dir)], check=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        cwd=args.clone_dir,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    result: dict[str, object] = {
        "commit": commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpus": os.cpu_count(),
        "load_average_before": os.getloadavg(),
    }
    for run in ("fresh_clone", "installed"):
        result[run] = time_one_start(args.clone_dir, args.port, args.clone_dir / f"make-up-{run}.log")
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
