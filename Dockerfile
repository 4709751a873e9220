# syntax=docker/dockerfile:1
#
# tokenwire images. Two targets from one build:
#
#   docker build --target sidecar -t tokenwire-sidecar .   # the proxy: no torch (see README, "Deploy")
#   docker build --target engine  -t tokenwire-engine  .   # the torch engine (CPU torch by default)
#
# Both run as an unprivileged user and read their settings from /etc/tokenwire/*.toml
# (copies of conf/), overridable per key by TOKENWIRE_* / TOKENWIRE_ENGINE_* variables
# or flags appended to the command. tests/test_deploy_configs.py runs the same
# ENTRYPOINT + CMD outside Docker and lints this file with hadolint.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: the wheel, once, for both targets, its hot modules compiled with mypyc
# (setup.py). The C compiler (and Python's headers, where the base has none: Debian's
# own python3) are in this stage only; the runtime stages get the built wheel.
FROM ${PYTHON_IMAGE} AS build
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && if ! python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'; then \
        apt-get install -y --no-install-recommends python3-dev; fi \
    && rm -rf /var/lib/apt/lists/*
# Every stage installs into a virtualenv: Debian's python3 refuses a system-wide pip (PEP 668).
RUN python3 -m venv /opt/build && /opt/build/bin/pip install --no-cache-dir "build==1.2.2"
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY tokenwire/ tokenwire/
COPY middleware/ middleware/
COPY sidecar/ sidecar/
COPY engine/ engine/
# TOKENWIRE_REQUIRE_COMPILED: a build that could not compile fails here instead of
# shipping the pure wheel (~1.5x the CPU per event).
RUN TOKENWIRE_REQUIRE_COMPILED=1 /opt/build/bin/python -m build --wheel --outdir /dist . \
    && ls /dist/tokenwire-*-linux_*.whl

# ---- sidecar: tokenwire (compiled) with the extras the README documents for it:
# redis (--resume-store redis://), grpc (the gRPC listener), otel (OTLP traces); no torch
FROM ${PYTHON_IMAGE} AS sidecar
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/tokenwire/bin:$PATH \
    TOKENWIRE_LISTEN=0.0.0.0:8080 \
    TOKENWIRE_ADMIN_LISTEN=127.0.0.1:9090
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin tokenwire
COPY --from=build /dist/ /tmp/dist/
RUN python3 -m venv /opt/tokenwire \
    && pip install --no-cache-dir "$(find /tmp/dist -name 'tokenwire-*.whl')[redis,grpc,otel]" \
    && rm -rf /tmp/dist
COPY conf/sidecar.toml /etc/tokenwire/sidecar.toml
USER 10001
# The admin port (/metrics, /streams, cancel) stays inside the container unless it is
# opened on purpose, with a token: TOKENWIRE_ADMIN_LISTEN=0.0.0.0:9090 plus
# TOKENWIRE_ADMIN_TOKEN_FILE (or TOKENWIRE_ADMIN_TOKEN); the sidecar refuses to
# start on a non-loopback admin address without one.
EXPOSE 8080 9090
# Exec form: the sidecar is PID 1 and gets SIGTERM itself, so it drains (drain_s).
ENTRYPOINT ["tokenwire", "sidecar"]
CMD ["--config", "/etc/tokenwire/sidecar.toml"]

# ---- engine: torch (CPU wheels unless TORCH_INDEX_URL says otherwise) + transformers; no matplotlib (the `demo` extra)
FROM ${PYTHON_IMAGE} AS engine
ARG TORCH_VERSION=2.13.0
# For CUDA: --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Or a folder holding the torch wheel, mounted into the build (podman build -v), where
# the index cannot be reached: scripts/build-images.sh does that and says so.
ARG TORCH_FIND_LINKS=
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/tokenwire/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    TOKENWIRE_CACHE_DIR=/var/cache/tokenwire \
    TOKENWIRE_ENGINE_LISTEN=0.0.0.0:8001
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin tokenwire \
    && mkdir -p /var/cache/tokenwire /run/tokenwire \
    && chown 10001 /var/cache/tokenwire /run/tokenwire
# torch first, from its own index (or the folder), so the engine extra's `torch>=2.4`
# is already met and pip never reaches for PyPI's multi-GB CUDA build.
RUN python3 -m venv /opt/tokenwire \
    && if [ -n "${TORCH_FIND_LINKS}" ]; then \
        pip install --no-cache-dir --no-index --no-deps --find-links "${TORCH_FIND_LINKS}" "torch==${TORCH_VERSION}"; \
    else \
        pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"; fi
COPY --from=build /dist/ /tmp/dist/
RUN pip install --no-cache-dir "$(find /tmp/dist -name 'tokenwire-*.whl')[engine]" && rm -rf /tmp/dist
COPY conf/engine.toml /etc/tokenwire/engine.toml
USER 10001
# The embedded `tiny` model is built here once (about a minute of CPU), not at every start.
RUN python -c "from tokenwire.engine.tiny import ensure_tiny_model; ensure_tiny_model()"
EXPOSE 8001
ENTRYPOINT ["tokenwire", "engine"]
CMD ["--config", "/etc/tokenwire/engine.toml"]
