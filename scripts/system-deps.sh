#!/usr/bin/env bash
# Installs the system packages the tests and benchmarks use, only when missing.
# Usage: scripts/system-deps.sh PACKAGE...   (Debian names: redis-server nginx chromium nodejs npm curl nghttp2-client prometheus podman buildah mmdebstrap zsh haproxy)
set -euo pipefail
missing=()
for pkg in "$@"; do
    case "$pkg" in
        redis-server) bin=redis-server ;;
        nginx) bin=nginx ;;
        chromium) bin=chromium ;;
        nodejs) bin=node ;;
        nghttp2-client) bin=h2load ;;
        prometheus) bin=promtool ;;  # promtool ships in the prometheus package
        *) bin="$pkg" ;;
    esac
    command -v "$bin" >/dev/null 2>&1 || [ -x "/usr/sbin/$bin" ] || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "installing system packages: ${missing[*]}"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
