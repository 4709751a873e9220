#!/usr/bin/env bash
# Installs the npm packages of the client compatibility suite (openai-node,
# eventsource, the Anthropic TypeScript SDK, the Vercel AI SDK with its OpenAI
# and Anthropic providers, and @grpc/grpc-js for the gRPC tests) into
# tests/compat/clients/node/node_modules, exactly as locked in
# its package-lock.json, only when missing or older than the lock file.
# Node itself comes from Debian (scripts/system-deps.sh nodejs npm).
set -euo pipefail
cd "$(dirname "$0")/../tests/compat/clients/node"
stamp="node_modules/.package-lock.json"
if [ ! -f "$stamp" ] || [ package-lock.json -nt "$stamp" ]; then
    npm ci --no-audit --no-fund --loglevel=error
fi
