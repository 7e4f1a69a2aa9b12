#!/usr/bin/env bash
# Installs the system packages iadeep's build and tests need, if missing:
#   etcd-server        the real etcd the tests start on a loopback port
#   protobuf-compiler  protoc, needed by etcd-client's build script
#   libprotobuf-dev    the well-known .proto files protoc includes
#   python3, python3-venv  the virtual environment the Python package's tests run in
set -euo pipefail
need=()
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || need+=(etcd-server)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
[ -e /usr/include/google/protobuf/descriptor.proto ] || need+=(libprotobuf-dev)
if ! command -v python3 >/dev/null 2>&1; then
    need+=(python3 python3-venv)
elif ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then
    need+=(python3-venv)
fi
[ ${#need[@]} -eq 0 ] && exit 0
echo "installing: ${need[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
