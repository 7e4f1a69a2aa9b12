#!/usr/bin/env bash
# Builds the Python package `iadeep` into a wheel (maturin) and runs its tests (pytest)
# against real `iadeep up --no-nvml` clusters started by the tests, with real PyTorch.
#
# The third-party packages live in a virtual environment outside the repository, kept
# between runs and shared by every clone on this machine (CI clones afresh each time):
# ${IADEEP_TEST_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/iadeep/test-venv}. Only what it
# lacks is installed, from PyPI: pytest, maturin, numpy, torch and lightning. PyPI's
# torch wheel brings the CUDA libraries (about 3 GB, a few minutes the first time) and
# runs on the CPU where there is no GPU; the iadeep.torch and Lightning tests run on it.
# This clone's wheel is unpacked into target/python-site (not into the shared venv, so
# two clones testing at once do not replace each other's `iadeep`). The wheel uses the
# dev profile, reusing target/debug (CARGO_TARGET_DIR is honoured).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${IADEEP_TEST_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/iadeep/test-venv}
py="$venv/bin/python"
mkdir -p "$(dirname "$venv")"
(
    # One installer at a time: a second run waits for the first one's install.
    flock 9
    if [ ! -x "$py" ]; then
        echo "python: creating the test venv $venv"
        python3 -m venv "$venv"
    fi
    missing=()
    "$py" -c "import pytest" 2>/dev/null || missing+=("pytest>=7")
    [ -x "$venv/bin/maturin" ] || missing+=("maturin>=1.9,<2")
    "$py" -c "import numpy" 2>/dev/null || missing+=("numpy")
    "$py" -c "import torch" 2>/dev/null || missing+=("torch")
    "$py" -c "import lightning.pytorch" 2>/dev/null || missing+=("lightning")
    if [ ${#missing[@]} -gt 0 ]; then
        echo "python: installing into $venv: ${missing[*]} (torch: ~3 GB the first time)"
        "$py" -m pip install -q --disable-pip-version-check "${missing[@]}"
    fi
) 9>"$venv.lock"

# The binary the tests drive (iadeep up, iadeep run, iadeep state).
cargo build -q -p iadeep-cli
target=$(realpath "${CARGO_TARGET_DIR:-target}")
start=$(date +%s)
rm -f "$target"/wheels/iadeep-*.whl
"$venv/bin/maturin" build -q -m python/Cargo.toml --out "$target/wheels" 2>&1 \
    | grep -v "^📦\|^🔗\|^🐍\|^⚠️  Warning: .*manylinux" || true
echo "python: maturin build took $(( $(date +%s) - start ))s"
site="$target/python-site"
rm -rf "$site"
"$py" -m pip install -q --disable-pip-version-check --no-deps --target "$site" "$target"/wheels/iadeep-*.whl
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
"$py" -c "import iadeep; print('python: import iadeep', iadeep.__version__, 'from', iadeep.__file__)"
"$py" -c "import torch, lightning, numpy; print('python: torch', torch.__version__, '(CUDA available:',
    torch.cuda.is_available(), ') lightning', lightning.__version__, 'numpy', numpy.__version__)"

# The per-step cost of the agent's hot path with the GIL held (a figure, not a test).
"$py" python/benches/step_cost.py

# From the repository's root, where no `iadeep` folder shadows the wheel (`python -m`
# puts the working directory first on the import path). The jobs the tests start use
# the same interpreter and PYTHONPATH.
IADEEP_BIN="$target/debug/iadeep" "$py" -m pytest -q -rs python/tests "$@"
