#!/usr/bin/env bash
# Builds the Python package `iadeep` into a wheel (maturin), installs it into a virtual
# environment (target/python-venv, kept between runs), and runs its tests (pytest)
# against real `iadeep up --no-nvml` clusters started by the tests.
#
# The venv sees the system's site-packages, so where torch (and lightning, numpy) are
# installed, the iadeep.torch tests and the examples' tests run; elsewhere they skip and
# this script says so. It never downloads torch. maturin and pytest come from PyPI when
# the environment lacks them. The wheel uses the dev profile, reusing target/debug.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=target/python-venv
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv --system-site-packages "$venv"
fi
py="$venv/bin/python"
missing=()
"$py" -c "import pytest" 2>/dev/null || missing+=("pytest>=7")
[ -x "$venv/bin/maturin" ] || command -v maturin >/dev/null 2>&1 || missing+=("maturin>=1.9,<2")
if [ ${#missing[@]} -gt 0 ]; then
    echo "installing into $venv: ${missing[*]}"
    "$py" -m pip install -q --disable-pip-version-check "${missing[@]}"
fi
maturin="$venv/bin/maturin"
[ -x "$maturin" ] || maturin=maturin

# The binary the tests drive (iadeep up, iadeep run, iadeep state).
cargo build -q -p iadeep-cli
start=$(date +%s)
rm -f target/wheels/iadeep-*.whl
"$maturin" build -q -m python/Cargo.toml --out target/wheels 2>&1 | grep -v "^📦\|^🔗\|^🐍\|^⚠️  Warning: .*manylinux" || true
echo "python: maturin build took $(( $(date +%s) - start ))s"
"$py" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps target/wheels/iadeep-*.whl
"$py" -c "import iadeep; print('python: import iadeep', iadeep.__version__, 'from', iadeep.__file__)"

for module in torch lightning numpy; do
    if version=$("$py" -c "import $module; print($module.__version__)" 2>/dev/null); then
        echo "python: $module $version is importable: its tests run"
    else
        echo "python: $module is not importable in $venv: its tests are skipped"
    fi
done

# The per-step cost of the agent's hot path with the GIL held (a figure, not a test).
"$py" python/benches/step_cost.py

# From the repository's root, where no `iadeep` folder shadows the installed wheel
# (`python -m` puts the working directory first on the import path).
IADEEP_BIN="$PWD/target/debug/iadeep" "$py" -m pytest -q -rs python/tests "$@"
