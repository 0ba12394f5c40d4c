#!/usr/bin/env bash
# Weight sync to a disaggregated generator (issue 35): full fine-tuning
# against LoRA on the same model, a SmolLM2-135M-shaped random Llama
# (hidden 576, 30 layers, vocab 49152, tied; 134.5M parameters), float32.
# Each mode runs a 3-step GRPO job on two local workers with
# `rl.generators = 1` and `max_staleness = 0`: trainer rank 0 sends the
# policy over the weight ring (the TCP ring between the two processes)
# before every round, and the generator logs the bytes it received and the
# seconds the transfer took. LoRA: rank 16 on every linear.
# Prints one JSON line per mode: {"mode", "bytes", "seconds": [...],
# "median_s"}, then one with the ratios.
# BIN=dir picks the binaries (default target/debug, built by setup.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${BIN:-}" ]]; then
  scripts/setup.sh >&2
  BIN=target/debug
fi
accrue="$(cd "$BIN" && pwd)/accrue"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
cat > smol.json <<'JSON'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
 "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
 "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 2048,
 "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "initializer_range": 0.02,
 "tie_word_embeddings": true, "bos_token_id": 256, "eos_token_id": 257}
JSON
"$accrue" data synth --task arithmetic-small --rows 64 --out data >&2
for mode in full lora; do
  lora=""
  [[ "$mode" == lora ]] && lora=$'[lora]\nrank = 16\nalpha = 32\n'
  cat > "$mode.toml" <<TOML
[job]
name = "sync-$mode"
seed = 3
steps = 3
output_dir = "out/$mode"
[model]
init = "random"
config = "smol.json"
[data]
source = "generate"
format = "prompts"
train = ["data/arith-sft.jsonl"]
tokenizer = "bytes"
max_tokens = 256
[batch]
docs_per_step = 8
[objective]
kind = "pg"
[rl]
group_size = 4
max_staleness = 0
generators = 1
[rl.sampling]
temperature = 1.0
max_new_tokens = 2
[rl.verifier]
kind = "regex"
pattern = "[0-9]"
[checkpoint]
every_steps = 0
$lora
TOML
  "$accrue" local "$mode.toml" --workers 2 >&2
  python3 - "$mode" out/"$mode"/logs <<'PY'
import glob, json, re, statistics, sys
mode, logs = sys.argv[1], sys.argv[2]
rows = []
for f in glob.glob(f"{logs}/worker-*.log"):
    for line in open(f):
        if "policy received from trainer rank 0" in line:
            b = int(re.search(r" bytes=(\d+)", line).group(1))
            s = float(re.search(r" seconds=([0-9.e-]+)", line).group(1))
            rows.append((b, s))
assert rows, "the generator logged no sync"
secs = [s for _, s in rows]
print(json.dumps({"mode": mode, "bytes": rows[0][0], "seconds": secs,
                  "median_s": statistics.median(secs)}))
PY
done | tee rows.jsonl
python3 - <<'PY'
import json
rows = {r["mode"]: r for r in map(json.loads, open("rows.jsonl"))}
f, l = rows["full"], rows["lora"]
print(json.dumps({"bytes_ratio": f["bytes"] / l["bytes"],
                  "seconds_ratio": f["median_s"] / l["median_s"]}))
PY
