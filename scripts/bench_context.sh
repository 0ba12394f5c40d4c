#!/usr/bin/env bash
# Context parallelism's memory (issue 37): one training forward + backward
# (per-layer recomputation) of ONE document, on a Llama of hidden 256
# (8 query heads over 2 kv heads), 2 layers, vocab 8192, fp32: a rank alone
# on a SHORT document (default 16,384 tokens) beside RANKS ranks (default
# 4, separate processes meeting over the TCP ring, one thread each) on a
# LONG one (default 65,536), each printing its seconds and peak RSS growth
# over the built model. The issue's target: the long document on RANKS
# ranks within the memory one rank uses for the short one.
#   scripts/bench_context.sh
#   ACCRUE_BENCH_CP_SHORT=4096 ACCRUE_BENCH_CP_LONG=16384 scripts/bench_context.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
profile=(--release)
[ "${ACCRUE_BENCH_PROFILE:-release}" = dev ] && profile=()
bin=$(cargo test "${profile[@]}" -q -p accrue-worker --test bench --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])' | tail -1)
run() { # tokens ranks
  local dir
  dir=$(mktemp -d)
  for r in $(seq 0 $(($2 - 1))); do
    ACCRUE_BENCH_CP_T=$1 ACCRUE_BENCH_CP_RANKS=$2 ACCRUE_BENCH_CP_RANK=$r ACCRUE_BENCH_CP_DIR=$dir \
      OMP_NUM_THREADS=1 "$bin" --ignored --exact --nocapture bench_context_rank 2>/dev/null | grep '^{' &
  done
  wait
  rm -rf "$dir"
}
run "${ACCRUE_BENCH_CP_SHORT:-16384}" 1
run "${ACCRUE_BENCH_CP_LONG:-65536}" "${ACCRUE_BENCH_CP_RANKS:-4}"
