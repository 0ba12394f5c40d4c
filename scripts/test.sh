#!/usr/bin/env bash
# The test suite: unit, property, in-process server and real-process tests
# (the end-to-end ones train a tiny model with the real worker).
# Sets up first (a no-op when .venv and the build are current). Tests that
# read ../shared/data skip when it is absent unless
# ACCRUE_REQUIRE_SHARED_DATA=1 (CI sets it). The status page test needs
# Chromium, installed here from Debian's packages; it skips without it unless
# ACCRUE_REQUIRE_CHROMIUM=1 (CI sets that too).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if ! scripts/install-chromium.sh; then
  if [ "${ACCRUE_REQUIRE_CHROMIUM:-}" = 1 ]; then
    exit 1
  fi
  echo "warning: Chromium could not be installed; the status page test will skip" >&2
fi
# shellcheck source=scripts/env.sh
source scripts/env.sh
cargo test --workspace "$@"
