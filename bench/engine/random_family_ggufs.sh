#!/usr/bin/env bash
# Random-weight Q4_K_M GGUFs of real model shapes, written the way a user's file is written:
# transformers writes the checkpoint (bench/engine/random_hf.py), llama.cpp's own converter the F16
# GGUF, llama-quantize the Q4_K_M. Needs ../shared/peers/setup_llama_server.sh run first.
#   OUT=/tmp/bench bash bench/engine/random_family_ggufs.sh qwen3-0.6b llama-3.2-1b smollm3-3b
set -euo pipefail
OUT=${OUT:-/tmp/bench}
PEERS=${PEERS:-/tmp/peers}
TYPE=${TYPE:-Q4_K_M}
LLAMA_CPP=$(dirname "$(find "$PEERS/sdist" -name convert_hf_to_gguf.py | head -1)")
QUANTIZE=$PEERS/llama-server-build/bin/llama-quantize
PYTHON=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT/stub/sentencepiece"
# the converter imports sentencepiece before it finds that these checkpoints have no tokenizer.model
echo "class SentencePieceProcessor: pass" > "$OUT/stub/sentencepiece/__init__.py"
for shape in "$@"; do
  final="$OUT/$shape.$TYPE.gguf"
  [ -f "$final" ] && { echo "have $final"; continue; }
  [ -d "$OUT/$shape-hf" ] || "$PYTHON" -m bench.engine.random_hf --shape "$shape" --out "$OUT/$shape-hf"
  PYTHONPATH="$LLAMA_CPP/gguf-py:$OUT/stub" "$PYTHON" "$LLAMA_CPP/convert_hf_to_gguf.py" "$OUT/$shape-hf" \
    --outtype f16 --outfile "$OUT/$shape.f16.gguf" 2>&1 | grep -v "Writing:" | tail -2
  rm -rf "$OUT/$shape-hf"
  "$QUANTIZE" "$OUT/$shape.f16.gguf" "$final" "$TYPE" 2>&1 | tail -2
  rm -f "$OUT/$shape.f16.gguf"
  ls -la "$final"
done
