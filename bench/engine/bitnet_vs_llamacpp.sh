#!/usr/bin/env bash
# The BitNet b1.58 benchmark model side by side: `tern engine` on the HF checkpoint (make_bitnet_hf) and
# llama-server on the same weights converted by llama.cpp's convert_hf_to_gguf.py and quantized to TQ2_0
# (convert_bitnet_hf + llama-quantize), with the peers' load client (../shared/peers/bench_openai_server.py
# and prompts.json), 128 greedy tokens a request, EOS ignored. Interleaved: tern c=1, llama c=1,
# tern c=16, llama c=16, ROUNDS times. One JSON line per run in OUT, then both servers' resident memory.
#   bash bench/engine/bitnet_vs_llamacpp.sh      (from the project root; commands in docs/quantization.md)
#   env: HF_DIR=/tmp/gguf/bitnet-2b4t-random-hf GGUF=/tmp/gguf/bitnet-2b4t-random-hf.TQ2_0.gguf
#        ROUNDS=1 THREADS=2 C1_REQ=16 C16_REQ=64 OUT=/tmp/bitnet-sbs.jsonl
set -u
PEERS="${PEERS:-$(cd "$(dirname "$0")/../../../shared/peers" 2>/dev/null && pwd)}"
LLAMA_SERVER="${LLAMA_SERVER:-/tmp/peers/llama-server-build/bin/llama-server}"
TOOLS_PY="${TOOLS_PY:-/tmp/peers/venv-tools/bin/python}"
HF_DIR="${HF_DIR:-/tmp/gguf/bitnet-2b4t-random-hf}"
GGUF="${GGUF:-/tmp/gguf/bitnet-2b4t-random-hf.TQ2_0.gguf}"
OUT="${OUT:-/tmp/bitnet-sbs.jsonl}"
ROUNDS="${ROUNDS:-1}"; THREADS="${THREADS:-2}"; C1_REQ="${C1_REQ:-16}"; C16_REQ="${C16_REQ:-64}"
PIDS=()
trap 'for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done' EXIT
wait_up() { for _ in $(seq 600); do curl -sf -o /dev/null "$1/v1/models" && return 0; sleep 1; done; return 1; }
run_bench() {
  "$TOOLS_PY" "$PEERS/bench_openai_server.py" --url "$1" --server "$2" --concurrency "$3" --requests "$4" \
    --ignore-eos --stream-usage --out "$OUT" --tag "$5" --note "bitnet-2b4t-random" ${6:+--model "$6"}
}

.venv/bin/tern engine --model "$HF_DIR" --port 18221 --num-threads "$THREADS" > /tmp/bitnet-sbs-tern.log 2>&1 &
TP=$!; PIDS+=($TP)
"$LLAMA_SERVER" -m "$GGUF" -c 4096 -np 16 --kv-unified -t "$THREADS" -tb "$THREADS" \
  --host 127.0.0.1 --port 18222 --no-webui > /tmp/bitnet-sbs-llama.log 2>&1 &
LP=$!; PIDS+=($LP)
wait_up http://127.0.0.1:18221 || { echo '{"error":"tern engine did not start"}'; tail -5 /tmp/bitnet-sbs-tern.log; exit 1; }
wait_up http://127.0.0.1:18222 || { echo '{"error":"llama-server did not start"}'; tail -5 /tmp/bitnet-sbs-llama.log; exit 1; }
TM=$(curl -s http://127.0.0.1:18221/v1/models | python3 -c 'import sys,json;print(json.load(sys.stdin)["data"][0]["id"])')
for r in $(seq "$ROUNDS"); do
  run_bench http://127.0.0.1:18221 tern 1 "$C1_REQ" "r$r" "$TM"
  run_bench http://127.0.0.1:18222 llama.cpp-server 1 "$C1_REQ" "r$r"
  run_bench http://127.0.0.1:18221 tern 16 "$C16_REQ" "r$r" "$TM"
  run_bench http://127.0.0.1:18222 llama.cpp-server 16 "$C16_REQ" "r$r"
done
rss_mb() { echo $(( $( (awk '/VmRSS/{print $2}' "/proc/$1/status"; for c in $(pgrep -P "$1"); do awk '/VmRSS/{print $2}' "/proc/$c/status"; done) 2>/dev/null | awk '{s+=$1} END {print s+0}') / 1024 )); }
echo "{\"rss_mb\": {\"tern\": $(rss_mb $TP), \"llama.cpp-server\": $(rss_mb $LP)}}" | tee -a "$OUT"
