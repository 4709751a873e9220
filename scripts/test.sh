#!/usr/bin/env bash
# The whole test suite, from a fresh checkout: virtualenv, system packages,
# lint, strict typing, the tests, and the built wheel checked in a clean venv.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup-venv.sh dev,engine
# Real Redis (resume store), headless Chromium (EventSource, playground),
# nginx (the ingress example is checked with nginx -t), and Node, npm and curl
# (clients of the compatibility suite, tests/compat/clients), h2load and
# nghttp (nghttp2-client: HTTP/2 clients of tests/sidecar/test_http2_clients.py),
# promtool (prometheus: /metrics checked by tests/sidecar/test_telemetry.py), and
# podman, buildah and mmdebstrap (the sidecar image built and checked, tests/test_images.py),
# zsh (the README's install lines read as zsh reads them, tests/test_install.py),
# haproxy (the load balancer of the rolling restart, tests/sidecar/test_rolling_restart.py).
scripts/system-deps.sh redis-server chromium nginx nodejs npm curl nghttp2-client prometheus \
    podman buildah mmdebstrap zsh haproxy
# openai-node and eventsource for the compatibility suite, from its lock file.
scripts/node-deps.sh
py=.venv/bin/python
echo "== ruff"; $py -m ruff check tokenwire middleware sidecar engine tests bench testbed setup.py
echo "== mypy --strict (middleware, sidecar, engine, tools)"; scripts/typecheck.sh
echo "== pytest"; $py -m pytest -q -p no:cacheprovider "$@"
