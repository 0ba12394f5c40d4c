#!/usr/bin/env bash
# Sets up a fresh clone: a Python venv in .venv with PyTorch 2.13.0 from PyPI
# (the worker links its libtorch), then builds every binary. Needs the Rust
# toolchain and Python 3 with venv/pip. Safe to re-run: what is there is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "error: cargo not found; install Rust from https://rustup.rs" >&2; exit 1; }
torch_version=2.13.0
if [ ! -x .venv/bin/python ]; then
  command -v python3 >/dev/null || { echo "error: python3 not found; the worker needs PyTorch's libtorch" >&2; exit 1; }
  python3 -m venv .venv
fi
if ! .venv/bin/python -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$torch_version')" 2>/dev/null; then
  echo "installing torch==$torch_version into .venv (once; large download)"
  # ~5 GB installed (with its CUDA libraries, which the cuda worker links),
  # and the build another ~10 GB: say so up front rather than fail midway.
  free_kb=$(df -Pk . | awk 'NR == 2 { print $4 }')
  if [ "${free_kb:-0}" -lt $((16 * 1024 * 1024)) ]; then
    echo "warning: $((free_kb / 1024)) MiB free on $(df -P . | awk 'NR == 2 { print $6 }'); setup needs ~16 GB (torch ~5 GB, the build ~10 GB)" >&2
  fi
  # No wheel cache: it would hold a second copy of the ~3 GB of wheels.
  .venv/bin/pip install -q --no-cache-dir "torch==$torch_version"
fi
# shellcheck source=scripts/env.sh
source scripts/env.sh
cargo build --workspace --bins
echo "built: target/debug/accrue, target/debug/accrue-coordinator, target/debug/accrue-worker"
