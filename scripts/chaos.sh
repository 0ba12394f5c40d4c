#!/usr/bin/env bash
# The chaos soak (tests/tests/chaos.rs, issue 14): a seeded random schedule
# of worker kills, freezes, joins, drains and coordinator restarts over a
# 48-step job at ddp and fsdp, checked for exactly-once training and the
# parameters of an uninterrupted run.
#
#   scripts/chaos.sh            one fresh random seed
#   scripts/chaos.sh 5          five fresh random seeds
#   ACCRUE_CHAOS_SEEDS=1,2,3 scripts/chaos.sh    these seeds
#   ACCRUE_CHAOS_SHARDING=ddp scripts/chaos.sh   one sharding only
#   ACCRUE_TEST_FAMILY=qwen3 scripts/chaos.sh    a tiny Qwen3 instead of Llama
#   ACCRUE_CHAOS_LORA=1 ACCRUE_CHAOS_SHARDING=ddp scripts/chaos.sh
#                                                LoRA adapters over a frozen base
#   ACCRUE_CHAOS_CONTEXT=2 ACCRUE_CHAOS_SHARDING=ddp scripts/chaos.sh
#                                                one context-parallel group of 2
#
# Prints each seed's schedule first (a failure reproduces with
# ACCRUE_CHAOS_SEEDS=<seed>), then a summary: per seed and sharding, pass or
# fail, the time taken and the faults injected. A failure keeps every
# process's log under ${TMPDIR:-/tmp}/accrue-chaos-seed-<seed>-<sharding>/
# (a pass too with ACCRUE_CHAOS_KEEP_LOGS=1).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# shellcheck source=scripts/env.sh
source scripts/env.sh

n="${1:-1}"
if [ -z "${ACCRUE_CHAOS_SEEDS:-}" ]; then
  seeds=()
  for _ in $(seq "$n"); do
    seeds+=("$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')")
  done
  ACCRUE_CHAOS_SEEDS="$(IFS=,; echo "${seeds[*]}")"
fi
export ACCRUE_CHAOS_SEEDS
unset ACCRUE_CHAOS_SEED
echo "chaos seeds: $ACCRUE_CHAOS_SEEDS"

# Build once, then run a snapshot of the binaries (hard links), so another
# build into a shared target directory cannot replace them mid-soak.
cargo build -q -p accrue-coordinator -p accrue-cli -p accrue-worker --bins
target="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
bins="$(mktemp -d)"
trap 'rm -rf "$bins"' EXIT
for b in accrue accrue-coordinator accrue-worker; do
  ln "$target/debug/$b" "$bins/$b" 2>/dev/null || cp "$target/debug/$b" "$bins/$b"
done
export ACCRUE_TEST_BINS="$bins"

filter=()
case "${ACCRUE_CHAOS_SHARDING:-}" in
  "") ;;
  ddp|fsdp) filter=("chaos_soak_${ACCRUE_CHAOS_SHARDING}" --exact) ;;
  *) echo "ACCRUE_CHAOS_SHARDING must be ddp or fsdp" >&2; exit 2 ;;
esac

log="$(mktemp)"
status=0
cargo test -p accrue-tests --test chaos -- --ignored --nocapture --test-threads 1 "${filter[@]}" 2>&1 | tee "$log" || status=$?
echo
echo "==== chaos summary (seeds $ACCRUE_CHAOS_SEEDS)"
grep -E '^chaos: (PASS|FAIL|logs kept|seed [0-9]+ [a-z]+: exactly|[a-z]+ reference run)' "$log" || true
rm -f "$log"
exit "$status"
