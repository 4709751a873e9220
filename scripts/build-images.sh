#!/usr/bin/env bash
# Builds the two images from ./Dockerfile with podman or Docker (whichever works
# here), then checks each by running commands inside it.
#
# Usage: scripts/build-images.sh [--sidecar-only] [--base debian|IMAGE]
#   --sidecar-only  the sidecar image alone (what tests/test_images.py builds)
#   --base debian   a Python base made here from Debian's packages (mmdebstrap),
#                   for a machine that cannot reach the registry's python image;
#                   it is made once and kept as localhost/tokenwire-base:bookworm
#   --base IMAGE    any Debian-based image with python3 3.11, venv and pip
#                   (default: the Dockerfile's python:3.11-slim-bookworm)
#
# The checks (exit 1 and the failing step on the last line otherwise):
#   sidecar: runs as uid 10001; `tokenwire --version`; compiled_modules() non-empty;
#            the Redis client opens each resume store form (one server, Sentinel,
#            Cluster); the image's ENTRYPOINT + CMD (its config) proxies a stream from
#            a fake upstream on this machine and answers /readyz;
#   engine:  the tiny model is in the image; its ENTRYPOINT + CMD serves a
#            streamed completion.
# Prints each image's size at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
# The checks' helpers (a free port, the fake upstream, JSON) need only the standard library.
py="$root/.venv/bin/python"; [ -x "$py" ] || py="$(command -v python3)"
version="$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -1)"
sidecar_only=0
base=""
while [ $# -gt 0 ]; do
    case "$1" in
        --sidecar-only) sidecar_only=1 ;;
        --base) base="${2:?--base needs debian or an image}"; shift ;;
        *) echo "build-images: unknown argument $1 (see the top of $0)" >&2; exit 2 ;;
    esac
    shift
done
say() { echo "build-images: $*"; }
fail() { echo "build-images: FAILED: $*" >&2; exit 1; }

# ---- the tool: podman where it is (chroot isolation: no daemon, no OCI runtime
# needed), else a running Docker engine.
if command -v podman >/dev/null 2>&1 && podman info >/dev/null 2>&1; then
    tool=podman
    build=(podman build --isolation=chroot)
elif command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
    tool=docker
    build=(docker build)
else
    echo "build-images: neither podman nor a running Docker engine here (scripts/system-deps.sh podman buildah installs podman)" >&2
    exit 3
fi
say "building with $tool"

# ---- the base
base_args=()
if [ "$base" = "debian" ]; then
    base=localhost/tokenwire-base:bookworm
    if ! "$tool" image inspect "$base" >/dev/null 2>&1; then
        command -v mmdebstrap >/dev/null || fail "--base debian needs mmdebstrap (scripts/system-deps.sh mmdebstrap)"
        [ "$tool" = podman ] || fail "--base debian imports the base with podman"
        work="$(mktemp -d)"
        trap 'rm -rf "$work"' EXIT
        hooks=()
        # This machine's own certificate authorities (a TLS-inspecting egress, say),
        # so that pip inside the build trusts what pip here trusts.
        if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
            say "the base trusts this machine's CAs in /usr/local/share/ca-certificates too"
            hooks+=(--customize-hook='cp /usr/local/share/ca-certificates/*.crt "$1/usr/local/share/ca-certificates/"'
                    --customize-hook='chroot "$1" update-ca-certificates >/dev/null')
        fi
        say "making $base from Debian's packages (mmdebstrap, about 30 s)"
        # No python3-pip: every stage installs into a virtualenv, whose pip comes with
        # python3-venv; without Recommends (perl, build tools), as python:3.11-slim.
        # No manuals, translations or docs but the copyright files (about 50 MB).
        mmdebstrap --quiet --variant=minbase --aptopt='APT::Install-Recommends "false"' \
            --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/locale/*' \
            --dpkgopt='path-exclude=/usr/share/info/*' --dpkgopt='path-exclude=/usr/share/doc/*' \
            --dpkgopt='path-include=/usr/share/doc/*/copyright' \
            --include=python3,python3-venv,ca-certificates "${hooks[@]}" bookworm "$work/rootfs.tar" \
            || fail "mmdebstrap"
        # pip reads the system's CA bundle, not its own (certifi), as Debian's pip does.
        podman import --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
            "$work/rootfs.tar" "$base" >/dev/null || fail "podman import"
    fi
fi
[ -n "$base" ] && base_args=(--build-arg "PYTHON_IMAGE=$base")

# ---- the images
start=$(date +%s)
say "sidecar image: tokenwire-sidecar:$version (compiling the wheel takes a minute or two)"
"${build[@]}" "${base_args[@]}" --target sidecar -t "tokenwire-sidecar:$version" . \
    || fail "building the sidecar image"
say "sidecar image built in $(( $(date +%s) - start )) s"
if [ "$sidecar_only" = 0 ]; then
    torch_args=()
    torch_index="$(sed -n 's/^ARG TORCH_INDEX_URL=//p' Dockerfile)"
    if curl -fsS --max-time 10 -o /dev/null "$torch_index/torch/" 2>/dev/null; then
        say "torch: from $torch_index"
    else
        torch_version="$(sed -n 's/^ARG TORCH_VERSION=//p' Dockerfile)"
        wheel=""
        for dir in ${PIP_FIND_LINKS:-} /opt/wheels; do
            wheel="$(find "$dir" -maxdepth 1 -name "torch-${torch_version}*-cp311-*.whl" 2>/dev/null | head -1)"
            [ -n "$wheel" ] && break
        done
        [ -n "$wheel" ] || fail "torch: $torch_index cannot be reached and no torch-${torch_version} wheel lies here"
        [ "$tool" = podman ] || fail "torch: $torch_index cannot be reached; a local wheel needs podman (build -v)"
        say "torch: $torch_index cannot be reached; from the local wheel $wheel"
        torch_args=(-v "$(dirname "$wheel"):/wheels:ro" --build-arg TORCH_FIND_LINKS=/wheels)
    fi
    "${build[@]}" "${base_args[@]}" "${torch_args[@]}" --target engine -t "tokenwire-engine:$version" . \
        || fail "building the engine image"
    say "engine image built in $(( $(date +%s) - start )) s in all"
fi

# ---- inside the images
free_port() { "$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
entry() { "$tool" image inspect "$1" --format '{{join .Config.Entrypoint " "}} {{join .Config.Cmd " "}}'; }
pids=()
containers=()
cleanup() {
    for pid in "${pids[@]}"; do kill -- "$pid" 2>/dev/null || true; done
    if [ "$tool" = podman ]; then
        for ctr in "${containers[@]}"; do buildah rm "$ctr" >/dev/null 2>&1 || true; done
    fi
}
trap cleanup EXIT
# container IMAGE: a container of IMAGE to run commands in (removed at exit).
# inside CONTAINER CMD...: CMD run in it as the image's user, on this machine's network.
if [ "$tool" = podman ]; then
    command -v buildah >/dev/null || fail "the checks run commands with buildah (scripts/system-deps.sh buildah)"
    container() { buildah from --pull=never "$1"; }
    inside() { local ctr="$1"; shift; buildah run --isolation chroot --network host "$ctr" -- "$@"; }
else
    container() { echo "$1"; }
    inside() { local image="$1"; shift; docker run --rm --network host --entrypoint "$1" "$image" "${@:2}"; }
fi
# in the background, in a process group of its own (killed at exit, all of it)
background() { set -m; "$@" & set +m; pids+=("-$!"); }

check_sidecar() {
    local image="tokenwire-sidecar:$version" ctr upstream_port port admin_port log
    ctr="$(container "$image")"
    containers+=("$ctr")
    [ "$(inside "$ctr" id -u)" = 10001 ] || fail "sidecar: not running as uid 10001"
    inside "$ctr" tokenwire --version || fail "sidecar: tokenwire --version"
    # The Redis client of every resume store form (--resume-store redis://,
    # redis+sentinel://, redis+cluster://): opened, not connected.
    inside "$ctr" python -c '
import asyncio, redis, hiredis, tokenwire.middleware as m
from tokenwire.middleware.shared.redis_client import open_client
compiled = m.compiled_modules()
assert compiled, "no compiled modules: the image runs the pure-Python core"
forms = ("redis://127.0.0.1:1/0", "redis+sentinel://127.0.0.1:1/m", "redis+cluster://127.0.0.1:1")
async def close_all():
    for url in forms:
        await open_client(url)[0].aclose()
asyncio.run(close_all())
print(f"{len(compiled)} compiled modules; redis {redis.__version__}; resume stores: "
      + ", ".join(url.partition(":")[0] for url in forms))' || fail "sidecar: compiled modules or the Redis client"
    log="$(mktemp)"
    background "$py" "$root/testbed/fake_engine.py" --tokens 5 >"$log" 2>&1
    for _ in $(seq 100); do grep -q '^ready port=' "$log" && break; sleep 0.1; done
    upstream_port="$(sed -n 's/^ready port=//p' "$log")"
    [ -n "$upstream_port" ] || fail "sidecar: the fake upstream did not start: $(cat "$log")"
    port="$(free_port)"
    admin_port="$(free_port)"
    # The image's own ENTRYPOINT and CMD (its config file), with this machine's
    # addresses appended: a flag beats the file.
    read -r -a argv <<<"$(entry "$image")"
    background inside "$ctr" "${argv[@]}" --listen "127.0.0.1:$port" \
        --upstream "http://127.0.0.1:$upstream_port" --admin-listen "127.0.0.1:$admin_port" >"$log.sidecar" 2>&1
    for _ in $(seq 300); do
        curl -fsS -o /dev/null "http://127.0.0.1:$admin_port/readyz" 2>/dev/null && break; sleep 0.1
    done
    curl -fsS "http://127.0.0.1:$admin_port/readyz" >/dev/null \
        || fail "sidecar: /readyz did not answer 200: $(tail -5 "$log.sidecar")"
    curl -fsSN --max-time 20 "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
        -d '{"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]}' >"$log.out" \
        || fail "sidecar: the stream"
    grep -q '^data: \[DONE\]$' "$log.out" || fail "sidecar: the stream did not end with [DONE]: $(head -c 400 "$log.out")"
    say "sidecar: proxied a stream of $(grep -c '^data: {' "$log.out") chunks; /readyz 200"
    rm -f "$log" "$log.out" "$log.sidecar"
}

check_engine() {
    local image="tokenwire-engine:$version" ctr port out model
    ctr="$(container "$image")"
    containers+=("$ctr")
    inside "$ctr" python -c '
import os, pathlib
built = list(pathlib.Path(os.environ["TOKENWIRE_CACHE_DIR"]).glob("tiny-*/config.json"))
assert built, "the tiny model is not built in the image"
print("the tiny model:", built[0].parent)' || fail "engine: the tiny model"
    port="$(free_port)"
    read -r -a argv <<<"$(entry "$image")"
    background inside "$ctr" "${argv[@]}" --listen "127.0.0.1:$port"
    for _ in $(seq 600); do curl -fsS -o /dev/null "http://127.0.0.1:$port/health" 2>/dev/null && break; sleep 0.2; done
    model="$(curl -fsS "http://127.0.0.1:$port/v1/models" | "$py" -c \
        'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')" || fail "engine: /v1/models"
    out="$(curl -fsSN --max-time 60 "http://127.0.0.1:$port/v1/chat/completions" -H 'content-type: application/json' \
        -d '{"model": "'"$model"'", "stream": true, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}')" \
        || fail "engine: the streamed completion"
    grep -q '^data: \[DONE\]$' <<<"$out" || fail "engine: the stream did not end with [DONE]: ${out:0:400}"
    say "engine: streamed $(grep -c '^data: {' <<<"$out") chunks"
}

check_sidecar
[ "$sidecar_only" = 1 ] || check_engine
for image in tokenwire-sidecar tokenwire-engine; do
    [ "$image" = tokenwire-engine ] && [ "$sidecar_only" = 1 ] && continue
    size="$("$tool" image inspect "$image:$version" --format '{{.Size}}')"
    say "$image:$version: $(( size / 1000000 )) MB"
done
say "all checks passed"
