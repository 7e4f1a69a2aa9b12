#!/usr/bin/env bash
# Installs the system packages iadeep needs, if missing, through apt-get:
#   protobuf-compiler  protoc, run by the etcd client's build script (iadeep's own
#                      schema is compiled in Rust by protox and needs no protoc)
#   libprotobuf-dev    the well-known .proto files protoc includes
#   gcc, libc6-dev     a C compiler for the crates with C parts (ring, zstd)
#   etcd-server        the real etcd the tests start on a loopback port (not with --build)
#   python3, python3-venv  the virtual environment the Python package's tests run in
#                      (not with --build)
#   kubernetes-client  kubectl, whose `kubectl kustomize` renders deploy/kubernetes's
#                      overlays for their tests (not with --build; any kubectl will do)
#
# Usage: scripts/install-deps.sh [--build]   (--build: only what building needs)
set -euo pipefail
build_only=false
[ "${1:-}" = "--build" ] && build_only=true
need=()
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
[ -e /usr/include/google/protobuf/descriptor.proto ] || need+=(libprotobuf-dev)
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
if ! $build_only; then
    command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || need+=(etcd-server)
    command -v kubectl >/dev/null 2>&1 || need+=(kubernetes-client)
    if ! command -v python3 >/dev/null 2>&1; then
        need+=(python3 python3-venv)
    elif ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then
        need+=(python3-venv)
    fi
fi
[ ${#need[@]} -eq 0 ] && exit 0
echo "installing: ${need[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
if ! command -v apt-get >/dev/null 2>&1; then
    echo "apt-get not found: install ${need[*]} with your package manager" >&2
    exit 1
fi
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
