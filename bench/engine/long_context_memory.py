"""Resident memory with many long contexts at once: Tern against llama-server, one server at a time.

    tern bench long-context-memory --llama-server PATH --gguf gemma-3-1b.Q4_K_M.gguf \
        [--streams 16] [--context-tokens 4096] [--max-tokens 128] [--threads 2] [--servers tern llama]

For each server in turn, on the same GGUF and thread count: start it sized so ``--streams`` sequences
of ``--context-tokens`` tokens are resident at once, send ``--streams`` concurrent chat requests whose
prompts are distinct texts (``bench.engine.long_prompts``: no shared prefix, so no prefix cache
shares a block) of ``context - max_tokens`` tokens with the chat template's, ``max_tokens`` greedy
tokens each with EOS ignored, so every context ends at about ``--context-tokens``; sample the server's
``VmRSS`` (its process tree's) from ``/proc`` every ``--interval`` seconds while they run, and print
one JSON line a server: the idle RSS before the requests, the peak RSS during them, RSS and
``VmHWM`` after, the tokens the server reported in context, the largest mappings of its address
space (the KV pools among them), and its own log lines about its KV cache.

llama-server: ``-np STREAMS -c STREAMS*CONTEXT`` without ``--kv-unified``: each slot gets a cache of
its own of exactly CONTEXT cells (its ``n_ctx_seq``), the "16 slots of 4k" the question asks about;
unified, one slot could take the whole 64k and the others wait. Its cache type stays f16 (its default)
and so does the sliding-window cache (iSWA, not ``--swa-full``). Tern: ``--max-num-seqs STREAMS`` and a
``--kv-cache-gib`` that holds STREAMS x CONTEXT tokens in float16
(the C fast path's cache type), computed from the model's shape.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.engine import cpu_model
from bench.engine.openai_load import emit
from bench.engine.vs_llamacpp import default_gguf, wait_up

_KV_ITEMSIZE = 2  # float16, both servers' cache type here


def tree(pid: int) -> list[int]:
    """``pid`` and its children (a server may serve from a child process)."""
    with contextlib.suppress(OSError):
        return [pid, *(int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]
    return [pid]


def status_mb(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and VmHWM of ``pid``'s tree, in MB (VmHWM: the sum of each process's)."""
    out = dict.fromkeys(("VmRSS", "RssAnon", "RssFile", "VmHWM"), 0)
    for p in tree(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                key, _, value = line.partition(":")
                if key in out:
                    out[key] += int(value.split()[0])
    return {k: v // 1024 for k, v in out.items()}


def largest_mappings(pid: int, count: int = 6) -> list[dict[str, Any]]:
    """The ``count`` mappings of ``pid`` with the most resident memory: size and RSS in MB, path."""
    rows: list[dict[str, Any]] = []
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                start, end = (int(x, 16) for x in fields[0].split("-"))
                path = fields[5] if len(fields) > 5 else "[anon]"
                rows.append({"size_mb": round((end - start) / 2**20, 1), "path": path})
            elif fields[0] == "Rss:" and rows:
                rows[-1]["rss_mb"] = round(int(fields[1]) / 1024, 1)
    return sorted(rows, key=lambda r: -r.get("rss_mb", 0))[:count]


class Sampler(threading.Thread):
    """Reads the server's memory every ``interval`` seconds until stopped; keeps the peak."""

    def __init__(self, pid: int, interval: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.peak: dict[str, int] = {}
        self.samples = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            now = status_mb(self.pid)
            if now["VmRSS"] >= self.peak.get("VmRSS", -1):
                self.peak = now
            self.samples += 1
            if self.samples % 60 == 0:  # a long run's figures so far, should it not finish
                print(f"{self.samples} samples: now {now}, peak {self.peak}", file=sys.stderr, flush=True)
            self.done.wait(self.interval)


async def requests(url: str, prompts: list[str], max_tokens: int) -> list[dict[str, Any]]:
    """All prompts at once, greedy, EOS ignored; each response's usage."""
    limits = httpx.Limits(max_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(7200)) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one(prompt: str) -> dict[str, Any]:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": prompt}],
                "temperature": 0,
                "max_tokens": max_tokens,
                "ignore_eos": True,
            }
            r = await client.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
            return dict(r.json()["usage"])

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def tern_kv_gib(gguf: Path, tokens: int) -> float:
    """A ``--kv-cache-gib`` that holds ``tokens`` tokens of every layer's K and V in float16."""
    from engine.loader.load import load_config

    config = load_config(gguf)
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * _KV_ITEMSIZE
    return round(tokens * per_token / 2**30 + 0.01, 3)  # + 10 MB: a block or so over, never under


def commands(args: argparse.Namespace) -> dict[str, list[str]]:
    streams, context, threads = args.streams, args.context_tokens, str(args.threads)
    # A block (16 tokens) a stream of slack: Tern rounds each sequence up to whole blocks.
    kv_gib = tern_kv_gib(args.gguf, streams * (context + 16))
    tern = [sys.executable, "-m", "tern_cli", "engine", "--model", str(args.gguf), "--port", str(args.port)]
    tern += ["--num-threads", threads, "--max-num-seqs", str(streams)]
    tern += ["--kv-cache-gib", str(kv_gib), *args.tern_args.split()]
    llama = [str(args.llama_server), "-m", str(args.gguf), "-np", str(streams), "-c", str(streams * context)]
    llama += ["--no-kv-unified", "-t", threads, "-tb", threads, "--host", "127.0.0.1"]
    llama += ["--port", str(args.port), "--no-webui", *args.llama_args.split()]
    return {"tern": tern, "llama": llama}


def kv_log_lines(log: Path) -> list[str]:
    """The server's own lines about its KV cache (llama-server: llama_kv_cache / iswa; Tern: KV cache)."""
    keys = ("llama_kv_cache", "iswa", "KV cache", "n_ctx_seq", "n_swa", "CPU KV buffer")
    lines = log.read_text(errors="replace").splitlines()
    wanted = [line for line in lines if any(k in line for k in keys) and "engine.stats" not in line]
    return [line.strip()[:200] for line in wanted][:20]


@contextlib.contextmanager
def started(cmd: list[str], log: Path, name: str, url: str) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_up(url, process, name, timeout_s=900)
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


def measure(args: argparse.Namespace, server: str, prompts: list[str], work: Path) -> dict[str, Any]:
    cmd = commands(args)[server]
    log = work / f"{server}.log"
    url = f"http://127.0.0.1:{args.port}"
    with started(cmd, log, server, url) as process:
        time.sleep(args.settle)
        idle = status_mb(process.pid)
        sampler = Sampler(process.pid, args.interval)
        sampler.start()
        began = time.monotonic()
        usages = asyncio.run(requests(url, prompts, args.max_tokens))
        seconds = time.monotonic() - began
        sampler.done.set()
        sampler.join()
        time.sleep(args.settle)
        after = status_mb(process.pid)
        mappings = largest_mappings(process.pid)
    contexts = [u["prompt_tokens"] + u["completion_tokens"] for u in usages]
    return {
        "benchmark": "long-context-memory",
        "server": server,
        "command": " ".join(cmd),
        "streams": len(prompts),
        "context_tokens_min": min(contexts),
        "context_tokens_max": max(contexts),
        "context_tokens_total": sum(contexts),
        "prompt_tokens_max": max(u["prompt_tokens"] for u in usages),
        "completion_tokens_min": min(u["completion_tokens"] for u in usages),
        "idle_mb": idle,
        "peak_during_mb": sampler.peak,
        "after_mb": after,
        "samples": sampler.samples,
        "seconds": round(seconds, 1),
        "largest_mappings": mappings,
        "kv_log": kv_log_lines(log),
        "cpu": cpu_model(),
    }


def make_prompts(args: argparse.Namespace) -> list[str]:
    """Distinct texts whose chat-wrapped prompt is ``context - max_tokens`` tokens (the model's own
    template's tokens counted by its own tokenizer; each server reports what it counted)."""
    from bench.engine.long_prompts import long_prompts
    from engine.loader import load_tokenizer

    tokenizer = load_tokenizer(str(args.gguf))
    wrapper = len(tokenizer.encode_chat([{"role": "user", "content": ""}]))
    # 8 tokens short: decoded and encoded again, a text can come back a token or two longer, and
    # llama-server stops a slot's generation at its 4,096 cells.
    text_tokens = args.context_tokens - args.max_tokens - wrapper - 8
    return [tokenizer.decode(ids) for ids in long_prompts(tokenizer, text_tokens, args.streams)]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", type=Path, default=None, help="the peer's binary (llama: needed)")
    p.add_argument("--gguf", type=Path, default=None, help="the model both serve (default: the default one)")
    p.add_argument("--servers", nargs="+", choices=["tern", "llama"], default=["tern", "llama"])
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--context-tokens", type=int, default=4096, help="each stream's prompt + output")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=18203, help="the server's, each in turn")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    p.add_argument("--settle", type=float, default=2.0, help="seconds before the idle and after reads")
    p.add_argument("--tern-args", default="", help="more `tern engine` flags")
    p.add_argument("--llama-args", default="", help="more llama-server flags")
    p.add_argument("--log-dir", type=Path, default=None, help="keep the servers' logs here")
    p.add_argument("--out", type=Path, default=None, help="append each JSON line here too")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if "llama" in args.servers and (args.llama_server is None or not args.llama_server.is_file()):
        print("give --llama-server (../shared/peers/setup_llama_server.sh builds it)", file=sys.stderr)
        return 2
    args.gguf = (args.gguf or default_gguf()).resolve()
    prompts = make_prompts(args)
    with tempfile.TemporaryDirectory(prefix="tern-long-context-") as tmp:
        logs = args.log_dir or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for server in args.servers:
            emit(measure(args, server, prompts, logs), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
