"""The engine against llama.cpp's ``llama-server``, side by side in one sitting, on the same GGUF.

    tern bench engine-vs-llamacpp --llama-server PATH [--gguf FILE] [--rounds 3] [--out runs.jsonl]
    tern bench engine-vs-llamacpp --llama-server PATH --prompt-tokens 512 2048 7000   # long prompts
    tern bench engine-vs-llamacpp --llama-server PATH --gguf b.TQ2_0.gguf --tern-model <BitNet HF dir>

Starts ``tern engine`` (its defaults, ``--num-threads``, plus ``--tern-args``) and ``llama-server``
with the same thread count, then drives both with ``bench.engine.openai_load``, interleaved (Tern
c=1, llama c=1, Tern c=16, llama c=16, ``--rounds`` times): 128 greedy tokens a request, EOS ignored.
With ``--prompt-tokens``, for each length ``--count`` distinct prompts of exactly that many tokens
(``bench.engine.long_prompts``: no two share a prefix, so neither prefix cache helps), one at a time,
``--max-tokens`` (1: TTFT is the prefill time) with llama-server on one slot. One JSON line a run,
then each server's resident memory. Nothing here names a machine: the peer's binary is a flag
(build it with ``../shared/peers/setup_llama_server.sh``), the model defaults to the default model's
GGUF, and a random-weight model of real shapes comes from ``bench.engine.random_gguf``.
This replaces the peers folder's ``engine_vs_llamacpp.sh`` and the ``long_prompts_vs_llamacpp.sh`` and
``bitnet_vs_llamacpp.sh`` drivers (their results are under docs/benchmarks/engine-vs-llamacpp/).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.engine import openai_load

TERN_PORT, LLAMA_PORT = 18201, 18202


def rss_mb(pid: int) -> int:
    """Resident memory of a process and its children (the engine serves from a child process)."""
    total = 0
    pids = [pid]
    with contextlib.suppress(OSError):
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    for p in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
    return total // 1024


def wait_up(url: str, process: subprocess.Popen[bytes], name: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(json.dumps({"error": f"{name} exited with {process.returncode}"}))
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise SystemExit(json.dumps({"error": f"{name} did not start in {timeout_s:.0f} s"}))


@contextlib.contextmanager
def servers(args: argparse.Namespace, logs: Path) -> Iterator[tuple[int, int]]:
    """Both servers up; their pids."""
    slots = ["-np", "1", "-c", "8192"] if args.prompt_tokens else ["-np", "16", "-c", "4096", "--kv-unified"]
    threads = str(args.threads)
    tern_cmd = [sys.executable, "-m", "tern_cli", "engine", "--model", str(args.tern_model or args.gguf)]
    tern_cmd += ["--port", str(TERN_PORT), "--num-threads", threads, *args.tern_args.split()]
    llama_cmd = [str(args.llama_server), "-m", str(args.gguf), *slots, "-t", threads, "-tb", threads]
    llama_cmd += ["--host", "127.0.0.1", "--port", str(LLAMA_PORT), "--no-webui"]
    with (logs / "tern.log").open("wb") as tern_log, (logs / "llama.log").open("wb") as llama_log:
        tern = subprocess.Popen(tern_cmd, stdout=tern_log, stderr=subprocess.STDOUT)
        llama = subprocess.Popen(llama_cmd, stdout=llama_log, stderr=subprocess.STDOUT)
        try:
            wait_up(f"http://127.0.0.1:{TERN_PORT}", tern, "tern engine")
            wait_up(f"http://127.0.0.1:{LLAMA_PORT}", llama, "llama-server")
            yield tern.pid, llama.pid
        finally:
            for process in (tern, llama):
                process.terminate()
            for process in (tern, llama):
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()


def load(args: argparse.Namespace, port: int, server: str, *extra: str) -> None:
    argv = [f"--url=http://127.0.0.1:{port}", f"--server={server}", "--ignore-eos", "--stream-usage"]
    argv += [f"--max-tokens={args.max_tokens}", *extra]
    if args.out is not None and not any(a.startswith("--out=") for a in extra):
        argv.append(f"--out={args.out}")
    openai_load.main(argv)


def side_by_side(args: argparse.Namespace) -> None:
    for r in range(1, args.rounds + 1):
        for concurrency, requests in ((1, args.c1_requests), (16, args.c16_requests)):
            for port, server in ((TERN_PORT, "tern"), (LLAMA_PORT, "llama.cpp-server")):
                load(
                    args,
                    port,
                    server,
                    f"--concurrency={concurrency}",
                    f"--requests={requests}",
                    f"--tag=r{r}",
                )


def long_prompts(args: argparse.Namespace, work: Path) -> None:
    from bench.engine.long_prompts import long_prompts as make
    from engine.loader import load_tokenizer

    tokenizer = load_tokenizer(str(args.tern_model or args.gguf))
    for port in (TERN_PORT, LLAMA_PORT):  # warm both on a short prompt
        load(args, port, "warm-up", "--requests=1", "--warmup=0", "--max-tokens=4", "--out=/dev/null")
    for n in args.prompt_tokens:
        prompts = work / f"prompts-{n}.json"
        prompts.write_text(json.dumps([tokenizer.decode(ids) for ids in make(tokenizer, n, args.count)]))
        for port, server in ((TERN_PORT, "tern"), (LLAMA_PORT, "llama.cpp-server")):
            load(
                args,
                port,
                server,
                f"--requests={args.count}",
                "--warmup=0",
                f"--prompts={prompts}",
                f"--tag=prompt-{n}",
                f"--note=prompt_tokens={n} max_tokens={args.max_tokens}",
            )


def default_gguf() -> Path:
    from engine.loader.load import default_model_path

    return Path(default_model_path())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--llama-server",
        type=Path,
        default=os.environ.get("LLAMA_SERVER"),
        help="the peer's binary (default: $LLAMA_SERVER)",
    )
    p.add_argument(
        "--gguf", type=Path, default=None, help="the model both serve (default: the default model)"
    )
    p.add_argument(
        "--tern-model", type=Path, default=None, help="what Tern serves instead (e.g. a BitNet HF dir)"
    )
    p.add_argument("--tern-args", default="", help='more `tern engine` flags, e.g. "--dtype float32"')
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--c1-requests", type=int, default=16)
    p.add_argument("--c16-requests", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, nargs="*", default=[], help="long-prompt mode: lengths")
    p.add_argument("--count", type=int, default=3, help="long-prompt mode: prompts a length")
    p.add_argument("--max-tokens", type=int, default=None, help="default 128 (long prompts: 1)")
    p.add_argument("--out", type=Path, default=None, help="append each JSON line here too")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.llama_server is None or not args.llama_server.is_file():
        print(
            "give --llama-server (or $LLAMA_SERVER): ../shared/peers/setup_llama_server.sh builds it",
            file=sys.stderr,
        )
        return 2
    args.gguf = args.gguf or default_gguf()
    args.max_tokens = args.max_tokens or (1 if args.prompt_tokens else 128)
    with tempfile.TemporaryDirectory(prefix="tern-vs-llamacpp-") as tmp, servers(args, Path(tmp)) as pids:
        if args.prompt_tokens:
            long_prompts(args, Path(tmp))
        else:
            side_by_side(args)
        print(json.dumps({"rss_mb": {"tern": rss_mb(pids[0]), "llama.cpp-server": rss_mb(pids[1])}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
