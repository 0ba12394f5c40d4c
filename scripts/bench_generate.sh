#!/usr/bin/env bash
# Generation benchmark (issue 17): tokens/s of the worker's KV-cache
# generation (continuous batching, greedy) beside transformers' `generate`
# (greedy, use_cache=True) on the same random small Llama (4 layers,
# hidden 512, vocab 8192, float32, CPU), the same 8 prompts of 5–64 tokens
# and 64 new tokens each, run interleaved (ours, HF, ours, HF, …;
# ACCRUE_BENCH_ROUNDS pairs, default 3) in one process each; prints each
# run, the best and median tokens/s of each side and their ratios.
# ACCRUE_BENCH_PROFILE=dev skips the release build (slower Rust, same
# libtorch kernels). ACCRUE_BENCH_KV_PAGES="4096" also runs ours with that
# KV-cache page (4096: the static layout, one page per slot) in each round.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export ACCRUE_BENCH_DIR="$work" ACCRUE_BENCH_MAX_NEW="${ACCRUE_BENCH_MAX_NEW:-64}"
py=.venv/bin/python
profile=(--release)
[[ "${ACCRUE_BENCH_PROFILE:-release}" == dev ]] && profile=()
$py scripts/reference/bench_hf_generate.py make "$work" --batch 8
cargo test "${profile[@]}" -q -p accrue-worker --test generate --no-run 2>/dev/null
ours() { cargo test "${profile[@]}" -q -p accrue-worker --test generate -- --ignored --exact --nocapture bench_generate 2>/dev/null | grep '^{'; }
hf() { $py scripts/reference/bench_hf_generate.py run "$work" "$ACCRUE_BENCH_MAX_NEW"; }
for _ in $(seq "${ACCRUE_BENCH_ROUNDS:-3}"); do
  ours
  for page in ${ACCRUE_BENCH_KV_PAGES:-}; do ACCRUE_BENCH_KV_PAGE=$page ours; done
  hf
done | tee "$work/results.jsonl"
$py - "$work/results.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
runs = {}
for r in rows:
    runs.setdefault(r["impl"], []).append(r["tokens_per_s"])
for name, f in (("best", max), ("median", statistics.median)):
    got = {k: round(f(v), 1) for k, v in runs.items()}
    print(f"{name} tokens/s: {got}")
    for k in got:
        if k != "hf-generate" and "hf-generate" in got:
            print(f"{name} ratio {k} / hf-generate: {got[k] / got['hf-generate']:.2f}")
PY
