#!/usr/bin/env bash
# Served resident memory, by mapping, of `tern engine` (and with LLAMA=1 llama-server, started as
# ../shared/peers/engine_vs_llamacpp.sh starts it) after engine_vs_llamacpp's load (16 requests at 1
# stream, 64 at 16 streams) and one 2,048-token prompt; one JSON line per server and point (smaps.py).
# From the project root.  env: CHECKOUT (the code served, default .), GGUF, LLAMA=1, TERN_ARGS,
# TERN_ENV (e.g. MALLOC_ARENA_MAX=2), TAG, TP_PORT/LP_PORT, PY (default .venv/bin/python)
set -u
CHECKOUT="${CHECKOUT:-$PWD}"; GGUF="${GGUF:-/tmp/gguf/smollm2-135m.Q4_K_M.gguf}"; HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PY:-$CHECKOUT/.venv/bin/python}"; TOOLS_PY="${TOOLS_PY:-/tmp/peers/venv-tools/bin/python}"
BENCH="${BENCH:-$CHECKOUT/../shared/peers/bench_openai_server.py}"; TAG="${TAG:-x}"; OUT="/tmp/served-memory-$TAG.jsonl"
PIDS=(); trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done' EXIT
wait_up() { for _ in $(seq 300); do curl -sf -o /dev/null "$1/v1/models" && return 0; sleep 1; done; return 1; }
P2K=/tmp/served-memory-prompt-2048.json
[ -f $P2K ] || (cd $CHECKOUT && PYTHONPATH=$CHECKOUT $PY -m bench.engine.long_prompts --tokens 2048 --count 1 > $P2K)
( cd $CHECKOUT && PYTHONPATH=$CHECKOUT exec env ${TERN_ENV:-} $PY -m tern_cli engine --model "$GGUF" --port ${TP_PORT:-18341} --num-threads 2 ${TERN_ARGS:-} ) > /tmp/served-memory-tern-$TAG.log 2>&1 &
TP=$!; PIDS+=($TP)
SERVERS="http://127.0.0.1:${TP_PORT:-18341},tern,$TP"
if [ "${LLAMA:-0}" = 1 ]; then
  /tmp/peers/llama-server-build/bin/llama-server -m "$GGUF" -c 4096 -np 16 --kv-unified -t 2 -tb 2 \
    --host 127.0.0.1 --port ${LP_PORT:-18342} --no-webui > /tmp/served-memory-llama-$TAG.log 2>&1 &
  LP=$!; PIDS+=($LP); SERVERS="$SERVERS http://127.0.0.1:${LP_PORT:-18342},llama,$LP"
fi
for s in $SERVERS; do IFS=, read url name pid <<< "$s"; wait_up $url || { echo "$name did not start"; exit 1; }
  $PY "$HERE/smaps.py" $pid "$name up" "$GGUF"; done
for s in $SERVERS; do IFS=, read url name pid <<< "$s"
  $TOOLS_PY $BENCH --url $url --server $name --concurrency 1 --requests 16 --ignore-eos --stream-usage --out $OUT --tag $TAG > /dev/null
  $PY "$HERE/smaps.py" $pid "$name 1 stream" "$GGUF"
  $TOOLS_PY $BENCH --url $url --server $name --concurrency 16 --requests 64 --ignore-eos --stream-usage --out $OUT --tag $TAG > /dev/null
  $PY "$HERE/smaps.py" $pid "$name 16 streams" "$GGUF"
  $TOOLS_PY $BENCH --url $url --server $name --concurrency 1 --requests 1 --max-tokens 16 --ignore-eos --warmup 0 --prompts $P2K --out $OUT --tag $TAG-2k > /dev/null
  sleep 3
  $PY "$HERE/smaps.py" $pid "$name 2k prompt" "$GGUF"
done
