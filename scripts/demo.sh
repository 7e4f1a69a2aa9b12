#!/usr/bin/env bash
# The demo on a fresh Debian/Ubuntu machine with only a Rust toolchain: installs what
# building needs and is missing (scripts/install-deps.sh --build: protoc for the etcd
# client's build script, a C compiler), then runs `iadeep demo`. Arguments go to
# `iadeep demo`, e.g. scripts/demo.sh --worker-type p100.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --build
exec cargo run --release --locked --bin iadeep -- demo "$@"
