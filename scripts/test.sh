#!/usr/bin/env bash
# The test suite: unit, property, in-process server and real-process tests
# (the end-to-end ones train a tiny model with the real worker).
# Sets up first (a no-op when .venv and the build are current). Tests that
# read ../shared/data skip when it is absent unless
# ACCRUE_REQUIRE_SHARED_DATA=1 (CI sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# shellcheck source=scripts/env.sh
source scripts/env.sh
cargo test --workspace "$@"
