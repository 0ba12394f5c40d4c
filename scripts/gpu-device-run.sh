#!/usr/bin/env bash
# The GPU checks as run on a lent GPU machine that has no Rust toolchain
# and another PyTorch than ours (first used 2026-11-26 on an H100 with
# PyTorch 2.11 cu130): prebuilt binaries in .gpu/ (git-ignored through
# .git/info/exclude; carried to the machine), run against that machine's
# own PyTorch libraries.
#
# The binaries must be built against the machine's libtorch version (the
# C++ ABI changes between minor versions: binaries built against 2.13 ran
# into "tensor does not have a device" on 2.11). On the dev machine:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 torch==X.Y.Z -d W && unzip torch/include,lib,share from it;
#   copy torch-sys 0.26 out of ~/.cargo/registry, stub the generated
#   wrappers of ops that version lacks (the compile errors name them), and
#   build in a throwaway worktree with [patch.crates-io] torch-sys = {path};
#   LIBTORCH=W/torch LIBTORCH_BYPASS_VERSION_CHECK=1 cargo build --release
#     -p accrue-worker --features cuda --bin accrue-worker, and
#     cargo test --release -p accrue-worker --features cuda --test gpu --no-run;
#   strip them into .gpu/ as accrue-worker and gpu-tests, beside a release
#   `accrue` (no libtorch in it).
# Then run this script there from the repository root ($OUT: where logs go).
set -u
R=$PWD
B=$R/.gpu
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
SP=$(python3 -c 'import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))')
python3 -c 'import torch; print("device torch", torch.__version__, torch.version.cuda, torch.cuda.is_available())'
# The test binary finds scripts/reference and .venv under the checkout it
# was built in (CARGO_MANIFEST_DIR): make those paths lead here.
mkdir -p /work; for p in /work/main /work/gpuwt; do [ -e $p ] || ln -s "$R" $p; done
mkdir -p .venv/bin .venv/lib/python3.11
ln -sfn "$SP" .venv/lib/python3.11/site-packages
# A venv's python is found through its own path: a wrapper, not a link.
printf '#!/bin/sh\nexec %s "$@"\n' "$(python3 -c 'import sys; print(sys.executable)')" > .venv/bin/python; chmod +x .venv/bin/python
mkdir -p /tmp/ncclink
NCCL=$(ls "$SP"/nvidia/nccl/lib/libnccl.so.2 2>/dev/null | head -1)
[ -n "$NCCL" ] && ln -sfn "$NCCL" /tmp/ncclink/libnccl.so
export LD_LIBRARY_PATH=/tmp/ncclink:$SP/torch/lib
nvidia-smi -L
chmod +x $B/* 2>/dev/null
if ldd $B/accrue-worker | grep "not found"; then echo LDD_MISSING; fi
$B/accrue-worker --help >/dev/null 2>&1 && echo WORKER_LOADS || { echo WORKER_FAILS; $B/accrue-worker --help 2>&1 | tail -5; exit 3; }
T0=$(date +%s)
echo "== 1. gpu tests (parity, bf16-mixed, memory, generation)"
timeout ${GPU_TESTS_S:-150} $B/gpu-tests --ignored --nocapture --test-threads 1 > $OUT/gpu-tests.log 2>&1
echo "gpu tests rc=$? ($(( $(date +%s) - T0 )) s)"
grep -E "^test |test result|panicked|on Cuda|parity|bf16|memory|generation on|differ|skipped" $OUT/gpu-tests.log | head -40
W=/tmp/w; rm -rf $W; mkdir -p $W
$B/accrue data synth --task arithmetic --out $W/data >/dev/null
sft() { # name steps workers
  sed -e "s|^steps = .*|steps = $2|" -e "s|^output_dir = .*|output_dir = \"$W/$1\"|" \
    -e "s|runs/data/|$W/data/|" -e "s|^every_steps = .*|every_steps = 0|" \
    deploy/examples/sft-demo.toml > $W/$1.toml
  timeout ${SFT_S:-90} $B/accrue local $W/$1.toml --workers $3 --devices gpu > $W/$1.log 2>&1
  echo "$1 rc=$? ($(( $(date +%s) - T0 )) s)"
  python3 - $W/$1/metrics.jsonl <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
s = [r for r in rows if "loss" in r]
print(f"  {len(s)} steps, loss {s[0]['loss']:.3f} -> {s[-1]['loss']:.3f}, world {s[-1].get('world_size')}, "
      f"peak alloc {max(r.get('gpu_memory_peak_allocated_bytes', 0) for r in s)/2**20:.0f} MiB, {s[-1].get('tokens_per_s', 0):.0f} tok/s")
PY
  grep -h -E "joined the collective|staged|NCCL|duplicate|panicked|ERROR" $W/$1/logs/*.log 2>/dev/null | cut -c1-220 | sort | uniq -c | head -8
}
echo "== 2. SFT demo, 1 worker on the GPU, 20 steps"; sft sft1 20 1
echo "== 3. SFT, 2 workers on the one GPU (ddp), 10 steps"; sft sft2 10 2
echo "== 4. RL demo on the GPU (colocated, ${RL_STEPS:-60} GRPO steps)"
BIN=$B RL_STEPS=${RL_STEPS:-60} SFT_STEPS=50 timeout 100 scripts/rl-demo.sh > $W/rl.out 2> $W/rl.err; echo "rl rc=$? ($(( $(date +%s) - T0 )) s)"; tail -1 $W/rl.out; tail -3 $W/rl.err
echo "== 5. RL disaggregated, 2 workers on the one GPU (1 trains, 1 generates)"
BIN=$B RL_STEPS=${RL_STEPS:-60} SFT_STEPS=50 WORKERS=2 GENERATORS=1 timeout 100 scripts/rl-demo.sh > $W/rl2.out 2> $W/rl2.err; echo "rl2 rc=$? ($(( $(date +%s) - T0 )) s)"; tail -1 $W/rl2.out; tail -3 $W/rl2.err
grep -h -E "policy received|policy sent|configured as a generator|staged|joined the collective" runs/rl-demo/logs/*.log 2>/dev/null | cut -c1-200 | sed 's/^[^ ]* //' | sort | uniq -c | sort -rn | head -8
mkdir -p $OUT/logs; cp $W/*.log $W/*.err $OUT/logs/ 2>/dev/null; tar czf $OUT/runs.tgz -C /tmp w runs 2>/dev/null; tar czf $OUT/rl-demo-logs.tgz runs/rl-demo/logs 2>/dev/null
echo "done in $(( $(date +%s) - T0 )) s"
