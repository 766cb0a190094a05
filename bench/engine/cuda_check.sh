#!/usr/bin/env bash
# The engine on one GPU, checked in under 8 minutes: one JSON line on stdout as each phase ends (also
# appended to $OUT/check.jsonl), so a run cut by a time limit keeps what it measured. Engine logs go
# to $OUT/logs. Issue 50; docs/engine.md, "Triton kernels on a GPU".
#
#   bench/engine/cuda_check.sh                  # on the GPU machine, from the repo root
#   bench/engine/cuda_check.sh --prepare .gpu   # here, beforehand: what the GPU machine needs carried
#
# Phases (each under its own time limit, seconds):
#   env           GPU, driver, torch, Triton; modules the engine needs that do not import
#   kernel_tests  the Triton kernel tests on the GPU: every config of every tuning space compiles
#                 and matches its reference (tests/engine/test_kernel_tuning.py and the kernels')  120
#   parity        CUDA against CPU logits on the same weights (bench.engine.cuda_parity)           50
#   ready cold    tern engine (1B shape, INT4) start to /health and to first token, empty caches    100
#   ready warm    the same start with Triton's on-disk cache filled; radix-cache TTFT hit vs miss   45
#   serving_1b    1B-shape random model, INT4, ternary and bf16 at 1/16/64 streams, decode weight
#                 bandwidth against HBM peak (bench.engine.cuda_serving)                            150
#   serving_default  the default model's shapes, bf16 and INT4, same figures                         30
#   targets       the issue's targets from serving_1b
#
# What the GPU machine needs (it has no network). Assumed there: python3 with a CUDA build of torch,
# Triton, numpy and pytest (the device image had torch 2.11 + Triton 3.6). Carried in $ASSETS (default
# .gpu/, ignored by git, under 64 MiB), made by --prepare here:
#   $ASSETS/wheels/*.whl   the engine's pure-Python dependencies, downloaded by pip at this venv's
#                          versions (fastapi, pydantic, uvicorn, httpx, gguf, llguidance, tokenizers, ...;
#                          binary ones for this Python's version: the device's python3 must match it)
#   $ASSETS/tokenizer.gguf the default model's vocabulary (1.8 MB): the default model's file (98 MB)
#                          does not fit what travels, so random weights of its shapes stand in for it
# The models are written on the GPU machine (bench.engine.random_gguf): nothing else is needed.
set -u
cd "$(dirname "$0")/../.."
ASSETS=${TERN_CHECK_ASSETS:-.gpu}
PACKAGES="fastapi starlette pydantic pydantic-core pydantic-settings annotated-types typing-inspection
typing-extensions uvicorn h11 click anyio sniffio httpx httpcore certifi idna gguf llguidance orjson
opentelemetry-api importlib-metadata zipp prometheus-client tokenizers huggingface-hub jinja2 markupsafe
pyyaml tqdm filelock fsspec packaging safetensors python-dotenv"

if [ "${1:-}" = "--prepare" ]; then
    dir=${2:-.gpu}
    mkdir -p "$dir/wheels"
    python -m bench.engine.random_gguf --tokenizer-only --out "$dir/tokenizer.gguf" || exit 1
    pins=$(python -m pip freeze | grep -iE "^($(echo $PACKAGES | tr ' ' '|' | sed 's/-/[-_]/g'))==")
    python -m pip download -q --no-deps --only-binary=:all: --dest "$dir/wheels" $pins || exit 1
    exclude=$(git rev-parse --git-path info/exclude)   # inside the repo, the carried folder stays untracked
    case $dir in /*) ;; *) grep -qx "/$dir/" "$exclude" 2>/dev/null || echo "/$dir/" >> "$exclude" ;; esac
    du -sh "$dir"
    exit 0
fi

OUT=${OUT:-/tmp/tern-cuda-check}
L=$OUT/logs
WORK=/tmp/tern-cuda-check-work
mkdir -p "$L" "$WORK"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$WORK/site
export XDG_CACHE_HOME=$WORK/cache   # empty: the first engine start is a cold one
rm -rf "$XDG_CACHE_HOME"
emit() { echo "$1"; echo "$1" >> "$OUT/check.jsonl"; }
phase() {  # phase NAME LIMIT_S COMMAND...: its JSON lines (progress, then result), then its exit status
    local name=$1 limit=$2 start=$SECONDS rc pid watchdog
    shift 2
    # Its own process group, so that a phase cut at its limit takes the engines it started with it.
    setsid "$@" > "$L/$name.out" 2> "$L/$name.err" &
    pid=$!
    ( sleep "$limit"; kill -TERM -- -"$pid"; sleep 5; kill -KILL -- -"$pid" ) > /dev/null 2>&1 &
    watchdog=$!
    wait "$pid"
    rc=$?
    kill "$watchdog" > /dev/null 2>&1
    kill -KILL -- -"$pid" > /dev/null 2>&1
    grep -h '^{' "$L/$name.err" "$L/$name.out" | while read -r line; do emit "$line"; done
    emit "{\"phase\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - start)), \"cut\": $([ $rc -ge 128 ] && echo true || echo false)}"
}

if ls "$ASSETS"/wheels/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$WORK/site" "$ASSETS"/wheels/*.whl \
        > "$L/pip.log" 2>&1
fi
emit "$(python3 - <<'EOF'
import importlib, json, platform, subprocess
info = {"phase": "env", "python": platform.python_version()}
for name in ("torch", "triton"):
    try:
        info[name] = importlib.import_module(name).__version__
    except Exception as error:
        info[name] = repr(error)
try:
    import torch
    info["gpu"] = torch.cuda.get_device_name()
    info["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True).stdout.strip()
except Exception as error:
    info["gpu"] = repr(error)
needed = ("fastapi", "uvicorn", "pydantic", "httpx", "gguf", "llguidance", "tokenizers", "jinja2", "orjson",
          "prometheus_client", "pytest", "numpy")
info["missing"] = [m for m in needed if importlib.util.find_spec(m) is None]
print(json.dumps(info))
EOF
)"

TOKENIZER=$ASSETS/tokenizer.gguf
[ -f "$TOKENIZER" ] || TOKENIZER=$(python3 -c "from engine.loader.load import default_model_path as p; print(p())")
R1B=$WORK/r1b.gguf
DEFAULT=$WORK/rsmol.gguf
( python3 -m bench.engine.random_gguf --shape llama-3.2-1b --tokenizer-from "$TOKENIZER" --out "$R1B"
  python3 -m bench.engine.random_gguf --shape smollm2-135m --tokenizer-from "$TOKENIZER" --out "$DEFAULT"
) > "$L/models.log" 2>&1 &
MODELS=$!

# The kernel tests and parity compile into caches of their own, so the engine's first start stays cold.
TRITON_CACHE_DIR=$WORK/triton-tests phase kernel_tests 120 python3 -m pytest -q -p no:cacheprovider \
    --confcutdir=tests/engine tests/engine/test_kernel_tuning.py tests/engine/test_int4_kernels.py \
    tests/engine/test_ternary_kernels.py tests/engine/test_paged_attention.py
emit "$(tail -1 "$L/kernel_tests.out" | python3 -c 'import json,sys; print(json.dumps({"phase": "kernel_tests_summary", "line": sys.stdin.read().strip()}))')"
wait $MODELS
TRITON_CACHE_DIR=$WORK/triton-parity phase parity 50 python3 -m bench.engine.cuda_parity --model "$DEFAULT"

phase ready_cold 100 python3 -m bench.engine.cuda_check ready --model "$R1B" --quant int4 --label cold --log-dir "$L"
phase ready_warm 45 python3 -m bench.engine.cuda_check ready --model "$R1B" --quant int4 --label warm \
    --radix-pairs 4 --log-dir "$L"
phase serving_1b 150 python3 -m bench.engine.cuda_serving --model "$R1B" --quant int4 bitnet none --log-dir "$L"
cp "$L/serving_1b.out" "$OUT/serving_1b.json" 2>/dev/null
phase serving_default 30 python3 -m bench.engine.cuda_serving --model "$DEFAULT" --quant int4 none --log-dir "$L"
[ -s "$OUT/serving_1b.json" ] && emit "$(python3 -m bench.engine.cuda_check targets "$OUT/serving_1b.json")"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$L"
