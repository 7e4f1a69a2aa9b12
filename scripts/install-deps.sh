#!/usr/bin/env bash
# Installs the system packages iadeep's build and tests need, if missing:
#   etcd-server        the real etcd the tests start on a loopback port
#   protobuf-compiler  protoc, needed by etcd-client's build script
#   libprotobuf-dev    the well-known .proto files protoc includes
set -euo pipefail
need=()
command -v etcd >/dev/null 2>&1 || [ -x /usr/bin/etcd ] || need+=(etcd-server)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
[ -e /usr/include/google/protobuf/descriptor.proto ] || need+=(libprotobuf-dev)
[ ${#need[@]} -eq 0 ] && exit 0
echo "installing: ${need[*]}"
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
