#!/usr/bin/env bash
# The GPU checks of issue 15 in one command, for the first machine with a
# GPU (everything else runs on CPU in scripts/test.sh):
#  1. transformers parity on CUDA (logits, loss, gradients), bf16-mixed vs
#     fp32 over 20 steps, the GPU memory a step reports, and with >= 2 GPUs
#     2 ranks on NCCL at ddp/zero2/fsdp (+ the staged ring) against one rank
#     (worker/tests/gpu.rs, built with --features cuda); varlen flash
#     attention (issue 37) against the CPU's per-document attention, and its
#     tokens/s and peak memory at 8k/32k beside SDPA with repeated kv heads;
#  2. a 1-GPU SFT run of the demo (`accrue local`, 20 steps): the loss falls
#     and metrics.jsonl carries the GPU memory peaks;
#  3. tokens/s and MFU of one training step beside HF eager and HF sdpa on
#     the same GPU and batch, fp32 and bf16 (autocast / bf16-mixed).
# Without a GPU it prints a line containing "no GPU" and exits 0 (CI runs
# that path). Prints a summary; exits non-zero if any check fails.
set -euo pipefail
cd "$(dirname "$0")/.."

gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
if [ "${gpus:-0}" -eq 0 ]; then
  echo "gpu-check: no GPU (nvidia-smi missing or lists none): nothing to check"
  exit 0
fi

# shellcheck source=scripts/env.sh
source scripts/env.sh
py=.venv/bin/python
if ! $py -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "gpu-check: $gpus GPU(s) visible but the venv's PyTorch has no CUDA;" \
    "reinstall it from a CUDA wheel index (e.g. TORCH_INDEX=https://download.pytorch.org/whl/cu130 scripts/setup.sh)" >&2
  exit 1
fi
echo "gpu-check: $gpus GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c | xargs)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
failed=()
# cudarc dlopens NCCL as libnccl.so; PyTorch's wheel ships libnccl.so.2
# only, off the loader's path: link it where the loader looks (the worker
# image does the same with ldconfig).
nccl=$(find .venv/lib/ -name 'libnccl.so.2' 2>/dev/null | head -1)
if [ -n "$nccl" ]; then
  mkdir -p "$work/lib" && ln -s "$(realpath "$nccl")" "$work/lib/libnccl.so"
  export LD_LIBRARY_PATH="$work/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  echo "gpu-check: no libnccl.so.2 in .venv: NCCL checks will find the staged ring" >&2
fi

echo "== 1. parity, bf16-mixed, GPU memory, NCCL (worker/tests/gpu.rs)"
if ! cargo test --release -p accrue-worker --features cuda --test gpu -- \
  --ignored --nocapture --test-threads 1 2>&1 | tee "$work/gpu-tests.log"; then
  failed+=("worker/tests/gpu.rs")
fi

echo "== 2. 1-GPU SFT demo (20 steps)"
cargo build --release -q -p accrue-cli --bin accrue
cargo build --release -q -p accrue-worker --bin accrue-worker --features cuda
target/release/accrue data synth --task arithmetic --out "$work/data" >/dev/null
sed -e "s|^steps = .*|steps = 20|" \
  -e "s|^output_dir = .*|output_dir = \"$work/sft\"|" \
  -e "s|runs/data/|$work/data/|" \
  -e "s|^every_steps = .*|every_steps = 20|" \
  deploy/examples/sft-demo.toml >"$work/sft.toml"
if CUDA_VISIBLE_DEVICES=0 target/release/accrue local "$work/sft.toml" --workers 1 --devices gpu \
  >"$work/sft.log" 2>&1; then
  if ! $py - "$work/sft/metrics.jsonl" <<'PY'; then
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
steps = [r for r in rows if "loss" in r]
first, last = steps[0], steps[-1]
mem = max(r.get("gpu_memory_peak_allocated_bytes", 0) for r in steps)
print(f"demo on GPU: {len(steps)} steps, loss {first['loss']:.3f} -> {last['loss']:.3f}, "
      f"peak allocated {mem / 2**20:.0f} MiB, {last.get('tokens_per_s', 0):.0f} tokens/s")
assert last["loss"] < first["loss"], "the demo's loss did not fall"
assert mem > 0, "no GPU memory in metrics.jsonl"
PY
    failed+=("sft demo metrics")
  fi
else
  tail -20 "$work/sft.log"
  failed+=("sft demo run")
fi

echo "== 3. tokens/s and MFU beside HF (same GPU, same batch)"
export ACCRUE_BENCH_DIR="$work/bench"
mkdir -p "$ACCRUE_BENCH_DIR"
$py scripts/reference/bench_hf_step.py make-batch "$ACCRUE_BENCH_DIR/batch.safetensors"
{
  for precision in fp32 bf16-mixed; do
    ACCRUE_BENCH_DEVICE=cuda ACCRUE_BENCH_PRECISION=$precision ACCRUE_BENCH_STEPS=10 \
      cargo test --release -q -p accrue-worker --features cuda --test bench -- \
      --ignored --exact --nocapture bench_train_step 2>/dev/null | grep '^{' || true
  done
  for attn in eager sdpa; do
    for dtype in fp32 bf16; do
      $py scripts/reference/bench_hf_step.py run "$ACCRUE_BENCH_DIR/batch.safetensors" \
        --mode packed --steps 10 --device cuda --attn $attn --dtype $dtype || true
    done
  done
} | tee "$work/bench.jsonl"
$py - "$work/bench.jsonl" <<'PY' || failed+=("throughput table")
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
assert rows, "no benchmark rows"
flops = next((r["model_flops"] for r in rows if r.get("model_flops")), 0.0)
peak = next((r["peak_flops"] for r in rows if r.get("peak_flops")), 0.0)
print("| implementation | step s | tokens/s | MFU |")
print("|---|---|---|---|")
for r in rows:
    mfu = r.get("mfu") or (flops / r["step_s"] / peak if peak else 0.0)
    print(f"| {r['impl']} | {r['step_s']:.4f} | {r['tokens_per_s']:.0f} | {mfu:.3f} |")
PY

if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu-check: FAILED: ${failed[*]}"
  exit 1
fi
echo "gpu-check: all GPU checks passed"
