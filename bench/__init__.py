"""Tern's benchmarks, outside the product packages: ``bench.engine`` (a running engine, kernels,
quantization quality, structured output, speculation) and ``bench.gateway`` (the gateway's
throughput and added latency, its upstream client, prefix-cache routing). Each prints JSON;
``tern bench NAME`` runs one (``tern_cli/bench.py``). Benchmarks may import any package; no product
package imports them (tests/test_import_contract.py)."""
