"""``tern bench ...``: the gateway's and the engine's benchmarks, each printing JSON.

Each benchmark module is imported only when named, so ``tern bench gateway`` never imports torch.
"""

from __future__ import annotations

import sys

BENCHMARKS = {
    "gateway": "gateway.bench.gateway",
    "upstream-client": "gateway.bench.upstream_client",
    "engine": "engine.bench.serving",
    "engine-hf": "engine.bench.hf_baseline",
    "shared-prefix": "engine.bench.shared_prefix",
    "kernels": "engine.bench.kernels",
    "int4-quality": "engine.bench.int4_quality",
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: tern bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    import importlib

    return int(importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:]) or 0)
