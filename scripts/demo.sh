#!/usr/bin/env bash
# The main job: builds everything, writes the synthetic arithmetic data,
# starts a local coordinator, validates and submits deploy/examples/sft-demo.toml
# and shows its status. Training needs workers, which arrive with
# `accrue local` (worker issue); until then the job waits in `pending`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
bin=target/debug
$bin/accrue data synth --task arithmetic --out runs/data
$bin/accrue validate deploy/examples/sft-demo.toml
mkdir -p runs/state
$bin/accrue-coordinator --listen 127.0.0.1:0 --state-dir runs/state > runs/coordinator.out 2> runs/coordinator.log &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
for _ in $(seq 50); do grep -q "listening on" runs/coordinator.out 2>/dev/null && break; sleep 0.1; done
url="http://$(sed -n 's/^listening on //p' runs/coordinator.out)"
job=$($bin/accrue --coordinator "$url" submit deploy/examples/sft-demo.toml)
echo "submitted job $job to $url"
$bin/accrue --coordinator "$url" jobs
$bin/accrue --coordinator "$url" status "$job"
