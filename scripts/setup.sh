#!/usr/bin/env bash
# Builds the workspace (coordinator, CLI, worker). Needs only the Rust toolchain.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v cargo >/dev/null || { echo "error: cargo not found; install Rust from https://rustup.rs" >&2; exit 1; }
cargo build --workspace --bins
echo "built: target/debug/accrue, target/debug/accrue-coordinator"
