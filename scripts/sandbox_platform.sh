#!/usr/bin/env bash
# Real sandbox platforms for the marked suite (tests/test_platforms_real.py): a Docker daemon
# with no bridge (every address loopback), a base image made without a registry, an image with
# this checkout installed, and a real opensandbox-server on that daemon.
#
#   sandbox_platform.sh start STATE   # STATE: a new, short directory (sockets live in it)
#   sandbox_platform.sh stop STATE    # stops what start started, by PID; safe to repeat
#
# start writes STATE/env (KEY=VALUE lines) for the suite, which reads it from
# TRIO_GYM_PLATFORM_ENV: DOCKER_HOST, TRIO_GYM_HOST_IMAGE, OPEN_SANDBOX_DOMAIN,
# OPEN_SANDBOX_API_KEY, TRIO_GYM_PLATFORM_MOUNTS (a directory sandboxes may mount). Slow pieces
# are cached outside the checkout, in
# ${TRIO_GYM_CACHE:-~/.cache/trio-gym}/platform: Debian's packages once per machine, the
# debootstrap root file system, the daemon's images, opensandbox-server's venv.
# Exit 3: this machine cannot have the platform (not root, no apt-get); the suite then skips,
# saying so. Any other failure fails the run.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${TRIO_GYM_CACHE:-$HOME/.cache/trio-gym}/platform
BASE_IMAGE=trio-gym-base:bookworm
EXECD_IMAGE=trio-gym-execd:standin
HOST_IMAGE=trio-gym-host:ci
OPENSANDBOX_VERSION=1.1.1

say() { echo "sandbox_platform: $*" >&2; }

stop() {
  local state=$1
  if [[ -f "$state/opensandbox.pid" ]]; then
    kill "$(cat "$state/opensandbox.pid")" 2>/dev/null || true
    rm -f "$state/opensandbox.pid"
  fi
  if [[ -f "$state/docker.pid" ]]; then
    local pid
    pid=$(cat "$state/docker.pid")
    if kill -0 "$pid" 2>/dev/null; then
      # Whatever the suite left: it should be nothing, and the suite counts that itself.
      local left
      left=$(docker -H "unix://$state/docker.sock" ps -aq 2>/dev/null || true)
      if [[ -n "$left" ]]; then
        say "removing containers left behind: $(echo "$left" | tr '\n' ' ')"
        docker -H "unix://$state/docker.sock" rm -f $left >/dev/null 2>&1 || true
      fi
      kill "$pid"
      for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$state/docker.pid"
  fi
  # The daemon's network namespace stays mounted in its exec root after it ends.
  grep -o " $state/[^ ]*" /proc/mounts 2>/dev/null | sort -r | xargs -r umount 2>/dev/null || true
  rm -rf "$state" || say "could not remove $state"  # the server's key and database with it
}

wait_for() {  # wait_for SECONDS WHAT COMMAND...
  local seconds=$1 what=$2
  shift 2
  for _ in $(seq $((seconds * 10))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.1
  done
  say "$what was not up within ${seconds} s"
  return 1
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start() {
  local state=$1
  if [[ $(id -u) -ne 0 ]]; then
    say "needs root (a Docker daemon of its own); skipping"
    exit 3
  fi
  mkdir -p "$state" "$CACHE"

  if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
    if ! command -v apt-get >/dev/null; then
      say "no dockerd and no apt-get to install Debian's docker.io; skipping"
      exit 3
    fi
    say "installing Debian's docker.io and debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      docker.io fuse-overlayfs debootstrap iptables >"$state/apt.log" 2>&1 ||
      { apt-get update -q >>"$state/apt.log" 2>&1 &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
          docker.io fuse-overlayfs debootstrap iptables >>"$state/apt.log" 2>&1; } ||
      { tail -20 "$state/apt.log" >&2; exit 1; }
  fi

  # No bridge, no iptables, no forwarding: only the host and none networks exist.
  export DOCKER_HOST="unix://$state/docker.sock"
  dockerd --host "$DOCKER_HOST" --data-root "$CACHE/docker" --exec-root "$state/exec" \
    --pidfile "$state/docker.pid" --bridge=none --iptables=false --ip6tables=false \
    --ip-forward=false --ip-masq=false --userland-proxy=false >"$state/dockerd.log" 2>&1 &
  wait_for 60 "dockerd" docker info || { tail -20 "$state/dockerd.log" >&2; exit 1; }

  if ! docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    if [[ ! -f "$CACHE/bookworm-minbase.tar" ]]; then
      say "making a Debian base image with debootstrap (once per machine, ~75 s)"
      rm -rf "$CACHE/rootfs"
      mirror=$(grep -hoE '^URIs: *http[^ ]*debian/?$' /etc/apt/sources.list.d/*.sources 2>/dev/null |
        head -1 | sed 's/^URIs: *//')
      debootstrap --variant=minbase --include=python3,ca-certificates,procps bookworm \
        "$CACHE/rootfs" "${mirror:-http://deb.debian.org/debian}" >"$state/debootstrap.log" 2>&1 ||
        { tail -20 "$state/debootstrap.log" >&2; exit 1; }
      tar -C "$CACHE/rootfs" -cf "$CACHE/bookworm-minbase.tar.part" .
      mv "$CACHE/bookworm-minbase.tar.part" "$CACHE/bookworm-minbase.tar"
      rm -rf "$CACHE/rootfs"
    fi
    docker import "$CACHE/bookworm-minbase.tar" "$BASE_IMAGE" >/dev/null
  fi

  # OpenSandbox's execd cannot be built here: a stand-in that answers its readiness /ping.
  docker build -q --network none -t "$EXECD_IMAGE" -f "$ROOT/tests/platform/execd.Dockerfile" \
    "$ROOT/tests/platform" >"$state/build.log" 2>&1 || { tail -20 "$state/build.log" >&2; exit 1; }

  # The checkout's wheel and its dependencies', built here (pip in a build has no TLS here).
  local context="$state/host-image"
  rm -rf "$context" && mkdir -p "$context/wheels"
  python3 -m pip wheel -q --wheel-dir "$context/wheels" "$ROOT" pip >"$state/wheels.log" 2>&1 ||
    { tail -20 "$state/wheels.log" >&2; exit 1; }
  cp "$ROOT/scripts/gym_host.sh" "$ROOT/tests/platform/host.Dockerfile" "$context/"
  docker build -q --network none -t "$HOST_IMAGE" -f "$context/host.Dockerfile" "$context" \
    >>"$state/build.log" 2>&1 || { tail -20 "$state/build.log" >&2; exit 1; }

  local venv="$CACHE/opensandbox-$OPENSANDBOX_VERSION"
  if [[ ! -x "$venv/bin/opensandbox-server" ]]; then
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "opensandbox-server==$OPENSANDBOX_VERSION" >"$state/pip.log" 2>&1 ||
      { tail -20 "$state/pip.log" >&2; rm -rf "$venv"; exit 1; }
  fi
  local port api_key
  # What sandboxes may mount, read-only by the tests' choice: the directory the tests hand
  # packages in through, the cache holding real Gym's environment (scripts/gym_env.sh) and the
  # interpreters it may be built on (pyenv's). Nothing else of the machine.
  local gym_cache=${TRIO_GYM_CACHE:-$HOME/.cache/trio-gym}
  local pyenv_versions=${PYENV_ROOT:-$HOME/.pyenv}/versions
  mkdir -p "$state/mounts"
  port=$(free_port)
  api_key=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
  cat >"$state/opensandbox.toml" <<EOF
[server]
host = "127.0.0.1"
port = $port
api_key = "$api_key"

[runtime]
type = "docker"
execd_image = "$EXECD_IMAGE"

[docker]
network_mode = "host"

[ingress]
mode = "direct"

[proxy]
resolve_internal = true

[store]
type = "sqlite"
path = "$state/opensandbox.db"

[storage]
allowed_host_paths = ["$state/mounts", "$gym_cache", "$pyenv_versions"]
EOF
  "$venv/bin/opensandbox-server" --config "$state/opensandbox.toml" >"$state/opensandbox.log" 2>&1 &
  echo $! >"$state/opensandbox.pid"
  wait_for 60 "opensandbox-server" python3 -c \
    "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=1)" ||
    { tail -20 "$state/opensandbox.log" >&2; exit 1; }

  cat >"$state/env" <<EOF
DOCKER_HOST=$DOCKER_HOST
TRIO_GYM_HOST_IMAGE=$HOST_IMAGE
OPEN_SANDBOX_DOMAIN=127.0.0.1:$port
OPEN_SANDBOX_API_KEY=$api_key
TRIO_GYM_PLATFORM_MOUNTS=$state/mounts
EOF
  say "up: dockerd ($DOCKER_HOST), opensandbox-server $OPENSANDBOX_VERSION on 127.0.0.1:$port"
}

case "${1:-}" in
  start) start "${2:?usage: sandbox_platform.sh start STATE}" ;;
  stop) stop "${2:?usage: sandbox_platform.sh stop STATE}" ;;
  *) echo "usage: sandbox_platform.sh start|stop STATE" >&2; exit 2 ;;
esac
