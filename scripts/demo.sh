#!/usr/bin/env bash
# The demo on a fresh Debian/Ubuntu machine with only a Rust toolchain: installs what
# building needs and is missing (scripts/install-deps.sh --build: protoc for the etcd
# client's build script, a C compiler), then runs `iadeep demo` and names the plots it
# drew. Arguments go to `iadeep demo`, e.g. scripts/demo.sh --worker-type p100.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh --build
cargo run --release --locked --bin iadeep -- demo "$@"

# Where the plots went: --out DIR or --out=DIR, else iadeep demo's default.
out=iadeep-demo
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="${2:-$out}"; shift ;;
    --out=*) out="${1#--out=}" ;;
  esac
  shift
done
echo
echo "Plots (SVG; open them in a browser):"
for plot in completion_cdf.svg utilisation.svg tuner_iadeep.svg; do
  case "$plot" in
    completion_cdf.svg) what="completion-time CDF of every policy (iadeep thick red, oracle black dashed)" ;;
    utilisation.svg) what="GPUs busy over time, one panel per policy" ;;
    tuner_iadeep.svg) what="iadeep's batch size and PD of each job over time, per GPU" ;;
  esac
  if [ -f "$out/$plot" ]; then
    echo "  $out/$plot: $what"
  fi
done
