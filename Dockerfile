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

# ---- build: the wheel, once, for both targets
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
RUN pip install --no-cache-dir "build==1.2.2"
COPY pyproject.toml README.md LICENSE ./
COPY tokenwire/ tokenwire/
COPY middleware/ middleware/
COPY sidecar/ sidecar/
COPY engine/ engine/
RUN python -m build --wheel --outdir /dist .

# ---- sidecar: h11, h2, httpcore, uvloop, prometheus-client and tokenwire; nothing else
FROM ${PYTHON_IMAGE} AS sidecar
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TOKENWIRE_LISTEN=0.0.0.0:8080 \
    TOKENWIRE_ADMIN_LISTEN=127.0.0.1:9090
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin tokenwire
COPY --from=build /dist/ /tmp/dist/
RUN pip install --no-cache-dir /tmp/dist/tokenwire-*.whl && rm -rf /tmp/dist
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
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    TOKENWIRE_CACHE_DIR=/var/cache/tokenwire \
    TOKENWIRE_ENGINE_LISTEN=0.0.0.0:8001
RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin tokenwire \
    && mkdir -p /var/cache/tokenwire /run/tokenwire \
    && chown 10001 /var/cache/tokenwire /run/tokenwire
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY --from=build /dist/ /tmp/dist/
RUN pip install --no-cache-dir "$(find /tmp/dist -name 'tokenwire-*.whl')[engine]" && rm -rf /tmp/dist
COPY conf/engine.toml /etc/tokenwire/engine.toml
USER 10001
# The embedded `tiny` model is built here once (about a minute of CPU), not at every start.
RUN python -c "from tokenwire.engine.tiny import ensure_tiny_model; ensure_tiny_model()"
EXPOSE 8001
ENTRYPOINT ["tokenwire", "engine"]
CMD ["--config", "/etc/tokenwire/engine.toml"]
