#!/usr/bin/env bash
# Builds what the GPU machine needs and cannot fetch (it has no network) into one
# archive, target/gpu-carry.tar.xz, to carry there (see scripts/gpu/README.md):
#
#   gpu-carry/bin/iadeep     the iadeep binary (stripped)
#   gpu-carry/bin/etcd       etcd from Debian's etcd-server package (apt-get download)
#   gpu-carry/wheels/*.whl   the iadeep Python package (maturin)
#
# Usage: scripts/gpu/pack.sh [--dev]
#   --dev  the dev profile instead of release (quicker to build here; slower there)
#
# Needs cargo, maturin (scripts/test-python.sh installs it into target/python-venv)
# and apt-get. Prints the archive's size: what is carried must stay under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."

profile=release
dir=release
maturin_profile=(--release)
if [ "${1:-}" = "--dev" ]; then
    profile=dev
    dir=debug
    maturin_profile=()
elif [ $# -gt 0 ]; then
    echo "usage: $0 [--dev]" >&2
    exit 2
fi

out=target/gpu-carry
rm -rf "$out" target/gpu-carry.tar.xz
mkdir -p "$out/bin" "$out/wheels"

echo "pack: building the iadeep binary ($profile profile)"
cargo build --locked --profile "$profile" -p iadeep-cli
cp "target/$dir/iadeep" "$out/bin/iadeep"
strip "$out/bin/iadeep"

maturin=target/python-venv/bin/maturin
[ -x "$maturin" ] || maturin=$(command -v maturin || true)
if [ -z "$maturin" ]; then
    echo "pack: maturin not found; run scripts/test-python.sh once (it installs it into target/python-venv)" >&2
    exit 1
fi
echo "pack: building the iadeep wheel"
"$maturin" build -q "${maturin_profile[@]}" -m python/Cargo.toml --out "$out/wheels"

echo "pack: etcd from Debian's etcd-server package"
deb_dir=$(mktemp -d)
trap 'rm -rf "$deb_dir"' EXIT
(cd "$deb_dir" && apt-get download -q etcd-server >/dev/null)
dpkg-deb -x "$deb_dir"/etcd-server_*.deb "$deb_dir/root"
cp "$deb_dir/root/usr/bin/etcd" "$out/bin/etcd"

{
    echo "built $(date -u +%Y-%m-%dT%H:%M:%SZ) from $(git rev-parse HEAD 2>/dev/null || echo 'an unknown commit')"
    echo "profile: $profile"
    "$out/bin/iadeep" --version
    "$out/bin/etcd" --version | head -1
    ls "$out/wheels"
    echo "newest glibc symbol needed by iadeep: $(objdump -T "$out/bin/iadeep" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)"
} > "$out/MANIFEST"
cat "$out/MANIFEST"

tar -C target -cJf target/gpu-carry.tar.xz gpu-carry
size=$(stat -c %s target/gpu-carry.tar.xz)
echo "pack: target/gpu-carry.tar.xz is $((size / 1024 / 1024)) MiB ($size bytes)"
if [ "$size" -gt $((60 * 1024 * 1024)) ]; then
    echo "pack: warning: over 60 MiB; the device tool carries at most 64 MiB in all" >&2
fi
