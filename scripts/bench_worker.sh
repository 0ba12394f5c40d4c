#!/usr/bin/env bash
# Worker benchmarks, one command: builds in release and prints
#  (a) tokens/s of a training step, accrue's Trainer (both packed-attention
#      implementations) vs HF LlamaForCausalLM eager (packed via position_ids,
#      and a per-document loop), same config and tokens, and the ratio;
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
cargo test --release -q -p accrue-worker --test bench --no-run 2>/dev/null
run() { cargo test --release -q -p accrue-worker --test bench -- --ignored --exact --nocapture "$1" 2>/dev/null | grep '^{'; }
{
  run bench_train_step
  $py scripts/reference/bench_hf_step.py run "$work/batch.safetensors" --mode packed
  $py scripts/reference/bench_hf_step.py run "$work/batch.safetensors" --mode per-doc
  run bench_loss_memory_chunked
  run bench_loss_memory_naive
} | tee "$work/results.jsonl"
$py - "$work/results.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tps = {r["impl"]: r["tokens_per_s"] for r in rows if "impl" in r}
ours = tps.get("accrue-PerDocument")
for ref in ("pytorch-hf-packed", "pytorch-hf-per-doc"):
    if ours and ref in tps:
        print(f"ratio accrue-PerDocument / {ref}: {ours / tps[ref]:.2f}")
mem = {r["loss"]: r["peak_extra_mib"] for r in rows if "loss" in r}
if "chunked" in mem and "naive" in mem and mem["naive"] > 0:
    print(f"loss peak memory chunked / naive: {mem['chunked']:.0f} / {mem['naive']:.0f} MiB = {mem['chunked'] / mem['naive']:.3f}")
PY
