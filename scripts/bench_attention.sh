#!/usr/bin/env bash
# Attention memory and time at long sequence lengths (issue 37): one layer's
# forward + backward over one document of T tokens (4 query heads over 1 kv
# head of 64, fp32, 2 threads), accrue's packed path (causal SDPA per
# document, grouped-query attention without repeated k/v on the CPU) beside
# torch SDPA with enable_gqa and with transformers' repeat_kv, interleaved
# per T, each run in its own process (peak RSS growth is per process).
#   scripts/bench_attention.sh              T = 4096 16384 65536
#   ACCRUE_BENCH_ATTN_TS="4096" scripts/bench_attention.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
export OMP_NUM_THREADS=2
py=.venv/bin/python
profile=(--release)
[ "${ACCRUE_BENCH_PROFILE:-release}" = dev ] && profile=()
cargo test "${profile[@]}" -q -p accrue-worker --test bench --no-run 2>/dev/null
for t in ${ACCRUE_BENCH_ATTN_TS:-4096 16384 65536}; do
  ACCRUE_BENCH_ATTN_T=$t cargo test "${profile[@]}" -q -p accrue-worker --test bench -- \
    --ignored --exact --nocapture bench_attention 2>/dev/null | grep '^{'
  $py scripts/reference/bench_attention.py "$t" gqa
  $py scripts/reference/bench_attention.py "$t" repeat
done
