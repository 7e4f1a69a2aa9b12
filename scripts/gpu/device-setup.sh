#!/usr/bin/env bash
# On the GPU machine: unpacks the carried target/gpu-carry.tar.xz (scripts/gpu/pack.sh),
# unzips the iadeep wheel next to it (no pip, no network needed: the wheel is abi3),
# writes target/gpu-carry/env.sh to source (PATH, PYTHONPATH, IADEEP_BIN, ETCD_BIN),
# and prints what the measurements will run on: GPU, driver, Python, torch,
# torchvision, timm, pynvml, iadeep, etcd.
#
# Usage: scripts/gpu/device-setup.sh && . target/gpu-carry/env.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

if [ ! -f target/gpu-carry.tar.xz ]; then
    echo "device-setup: target/gpu-carry.tar.xz is missing: build it with scripts/gpu/pack.sh and carry it" >&2
    exit 1
fi
rm -rf target/gpu-carry
tar -C target -xJf target/gpu-carry.tar.xz
python3 - <<'EOF'
import glob, zipfile
wheels = glob.glob("target/gpu-carry/wheels/iadeep-*.whl")
if len(wheels) != 1:
    raise SystemExit(f"device-setup: expected one iadeep wheel, found {wheels}")
zipfile.ZipFile(wheels[0]).extractall("target/gpu-carry/pylib")
EOF
cat > target/gpu-carry/env.sh <<EOF
export PATH="$root/target/gpu-carry/bin:\$PATH"
export PYTHONPATH="$root/target/gpu-carry/pylib\${PYTHONPATH:+:\$PYTHONPATH}"
export IADEEP_BIN="$root/target/gpu-carry/bin/iadeep"
export ETCD_BIN="$root/target/gpu-carry/bin/etcd"
EOF
. target/gpu-carry/env.sh

cat target/gpu-carry/MANIFEST
echo "glibc here: $(ldd --version | head -1)"
iadeep --version
etcd --version | head -1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi: not available"
python3 - <<'EOF'
import importlib, platform
print("python", platform.python_version())
for name in ("torch", "torchvision", "timm", "pynvml", "iadeep"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "(no version)"))
    except Exception as error:  # noqa: BLE001 - a report, not a check
        print(name, "NOT importable:", error)
try:
    import torch
    print("cuda available:", torch.cuda.is_available(), "device:", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
except Exception as error:  # noqa: BLE001
    print("torch check failed:", error)
EOF
