#!/usr/bin/env bash
# The test suite: unit, property, in-process server and real-process tests.
# Tests that read ../shared/data skip when it is absent unless
# ACCRUE_REQUIRE_SHARED_DATA=1 (CI sets it).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo test --workspace "$@"
