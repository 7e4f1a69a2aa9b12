#!/usr/bin/env bash
# Runs iadeep's whole test suite on a fresh Debian/Ubuntu machine.
#
# Installs what the tests need and is missing (etcd-server for the real etcd the
# tests start, protobuf-compiler and libprotobuf-dev for etcd-client's build,
# python3-venv for the Python package's tests), then runs every test of the
# workspace, then builds the Python package and runs its tests against real
# `iadeep up` clusters (scripts/test-python.sh). The etcd tests never skip: without
# etcd they fail.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/install-deps.sh
echo "etcd: $( (etcd --version 2>/dev/null || /usr/bin/etcd --version) | head -1)"

cargo test --workspace "$@"
# The conformance suite prints which etcd server it talked to; show it. (`--workspace`
# keeps the features of the run above: `-p iadeep-tests` alone would rebuild a dozen
# crates with other features, minutes of CI for one test.)
cargo test --workspace --test it state_etcd::talks_to_a_real_etcd_server -- --nocapture 2>&1 \
    | grep -E "etcd conformance tests ran against|test result"

# The Python package: wheel, install, pytest against real `iadeep up` clusters.
scripts/test-python.sh
