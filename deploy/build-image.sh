#!/usr/bin/env bash
# Builds deploy/Dockerfile from the repo root with docker, else podman (whichever answers), and prints the time.
#   deploy/build-image.sh [--cpu] [TAG] [-- extra build flags]
# --cpu: the base is CPU_BASE_IMAGE (default: local/debian:bookworm when deploy/local/engine.sh made one here,
# else debian:bookworm) and torch the CPU wheel (TORCH, default torch==2.13.0+cpu): copied into deploy/wheels/
# when pip finds it on this machine, else fetched from TORCH_INDEX_URL (the PyTorch CPU index) during the build.
# Builds run with --network host: the builder needs no bridge network (dockerd may run with --bridge=none).
set -euo pipefail
cd "$(dirname "$0")/.."
cpu=0
if [ "${1:-}" = --cpu ]; then cpu=1; shift; fi
tag=${1:-}
[ $# -gt 0 ] && shift
[ "${1:-}" = -- ] && shift
PYTHON=${PYTHON:-.venv/bin/python}
if docker info > /dev/null 2>&1; then engine=(docker); export DOCKER_BUILDKIT=${DOCKER_BUILDKIT:-0}
elif command -v podman > /dev/null; then engine=(podman --runtime "${PODMAN_RUNTIME:-runc}")
else echo "build-image: neither a running Docker engine nor podman (deploy/local/engine.sh sets one up)" >&2; exit 1
fi
args=()
if [ "$cpu" = 1 ]; then
    tag=${tag:-tandem-rl:cpu}
    base=${CPU_BASE_IMAGE:-}
    if [ -z "$base" ]; then
        base=debian:bookworm
        "${engine[@]}" image inspect local/debian:bookworm > /dev/null 2>&1 && base=local/debian:bookworm
    fi
    torch=${TORCH:-torch==2.13.0+cpu}
    # A local wheel (pip's find-links here) saves the download; without one the build asks the CPU index.
    rm -f deploy/wheels/*.whl
    index=${TORCH_INDEX_URL-}
    if ! "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
            --python-version 3.11 --implementation cp --abi cp311 --no-index -d deploy/wheels "$torch" 2> /dev/null; then
        index=${index:-https://download.pytorch.org/whl/cpu}
        echo "build-image: no local $torch wheel; the build fetches it from $index"
    fi
    args+=(--build-arg "BASE_IMAGE=$base" --build-arg "TORCH=$torch" --build-arg "TORCH_INDEX_URL=$index")
fi
tag=${tag:-tandem-rl:local}
start=$(date +%s)
"${engine[@]}" build --network host --force-rm -f deploy/Dockerfile -t "$tag" "${args[@]}" "$@" .
echo "build-image: built $tag with ${engine[0]} in $(( $(date +%s) - start )) s;" \
     "$("${engine[@]}" image inspect "$tag" --format '{{.Size}}' | awk '{printf "%.2f GB", $1 / 1e9}')"
