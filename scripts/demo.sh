#!/usr/bin/env bash
# The main job: sets up (venv + build), writes the synthetic arithmetic data
# and trains deploy/examples/sft-demo.toml with a local coordinator and one
# worker (`accrue local`). The loss in the progress bar falls; per-step
# metrics land in runs/sft-demo/metrics.jsonl, checkpoints in
# runs/sft-demo/checkpoints/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
bin=target/debug
$bin/accrue data synth --task arithmetic --out runs/data
exec $bin/accrue local deploy/examples/sft-demo.toml --workers "${WORKERS:-1}"
