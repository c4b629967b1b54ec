#!/usr/bin/env bash
# Download, on a machine with internet, the wheels the air-gapped GPU machine lacks (it has torch, triton, transformers,
# safetensors, pytest, xdist, hypothesis but no internet) into .whl/ (git-ignored via .git/info/exclude).
# Copy .whl to the GPU machine with the checkout and `source scripts/staging/device_env.sh` there to install them.
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
# nox and its runtime dependencies (versions: whatever PyPI serves today; one version of each).
WHEELS=(nox argcomplete attrs colorlog dependency-groups humanize packaging platformdirs python-discovery virtualenv
        distlib filelock)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${WHEELS[@]}"
ls -la .whl
