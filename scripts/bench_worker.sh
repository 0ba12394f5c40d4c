#!/usr/bin/env bash
# Worker benchmarks, one command: builds in release and prints
#  (a) tokens/s of a training step, accrue's Trainer (both packed-attention
#      implementations) vs HF LlamaForCausalLM eager (packed via position_ids,
#      and a per-document loop), same config and tokens, and the ratio;
#      ACCRUE_BENCH_FAMILY=qwen3|olmo2|qwen3_moe for another family, ACCRUE_BENCH_LARGE=1
#      for a ~135M-parameter shape (SmolLM2-135M's), ACCRUE_BENCH_PROFILE=dev
#      for the dev build the README's first command makes;
#  (b) peak memory of the chunked vs naive LM head + cross-entropy at
#      T=8192, H=256, V=152064 (naive needs ~16 GiB of RAM; set
#      ACCRUE_BENCH_LOSS_T lower on a small machine).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
export OMP_NUM_THREADS=2
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export ACCRUE_BENCH_DIR="$work"
py=.venv/bin/python
$py scripts/reference/bench_hf_step.py make-batch "$work/batch.safetensors"
profile=(--release)
[ "${ACCRUE_BENCH_PROFILE:-release}" = dev ] && profile=()
cargo test "${profile[@]}" -q -p accrue-worker --test bench --no-run 2>/dev/null
run() { cargo test "${profile[@]}" -q -p accrue-worker --test bench -- --ignored --exact --nocapture "$1" 2>/dev/null | grep '^{'; }
{
  # Interleaved, ours then transformers', so both see the same machine.
  for _ in $(seq "${ACCRUE_BENCH_REPEATS:-1}"); do
    run bench_train_step
    $py scripts/reference/bench_hf_step.py run "$work/batch.safetensors" --mode packed
  done
  if [ -z "${ACCRUE_BENCH_STEP_ONLY:-}" ]; then
    $py scripts/reference/bench_hf_step.py run "$work/batch.safetensors" --mode per-doc
    run bench_loss_memory_chunked
    run bench_loss_memory_naive
  fi
} | tee "$work/results.jsonl"
$py - "$work/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
import statistics
tps = {}
for r in rows:
    if "impl" in r:
        tps.setdefault(r["impl"], []).append(r["tokens_per_s"])
tps = {k: statistics.median(v) for k, v in tps.items()}
ours = tps.get("accrue-PerDocument")
for ref in ("pytorch-hf-packed", "pytorch-hf-per-doc"):
    if ours and ref in tps:
        print(f"ratio accrue-PerDocument / {ref}: {ours / tps[ref]:.2f} ({ours:.0f} vs {tps[ref]:.0f} tokens/s, medians)")
mem = {r["loss"]: r["peak_extra_mib"] for r in rows if "loss" in r}
if "chunked" in mem and "naive" in mem and mem["naive"] > 0:
    print(f"loss peak memory chunked / naive: {mem['chunked']:.0f} / {mem['naive']:.0f} MiB = {mem['chunked'] / mem['naive']:.3f}")
PY
