#!/usr/bin/env bash
# Multi-turn episodes against tools of uneven latency (issue 36, continuous
# batching across turns): a GRPO job of the demo's tiny Llama whose
# environment program answers each policy turn from a thread of its own,
# TURNS tool turns before the answer; a tool call is slow (SLOW_S seconds)
# with probability P_SLOW, drawn per episode and turn (a hash of the
# episode's id and the turn), else instant — the
# heavy-tailed latencies of sandboxes and search tools. Prints one JSON
# line: the job's wall seconds, its steps' summed generation seconds,
# turns per episode.
#
#   scripts/bench_episodes.sh [BIN_DIR]    # default target/release
#
# Compare two builds by running it with each BIN_DIR in turn (interleaved,
# several times): the same prompts, seeds and latency distribution.
# STEPS (default 4), SLOW_S (1.0), P_SLOW (0.05), TURNS (3), NEW_TOKENS
# (48), WORKERS (2).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
bin="$(cd "${1:-$root/target/release}" && pwd)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
"$bin/accrue" data synth --task arithmetic-small --rows 64 --out data >/dev/null
cat > env.py <<'PY'
import hashlib, json, os, sys, threading, time
slow, turns = float(os.environ["SLOW_S"]), int(os.environ["TURNS"])
p_slow = float(os.environ["P_SLOW"])
lock = threading.Lock()
def answer(m):
    ep, turn = m["episode"], m["turn"]
    if turn <= turns:
        draw = int.from_bytes(hashlib.sha256(("%s/%d" % (ep, turn)).encode()).digest()[:4], "big")
        if draw < p_slow * 2**32:
            time.sleep(slow)
        out = {"episode": ep, "messages": [{"role": "tool", "content": "result-%d" % turn}]}
    else:
        r = float(len(m["content"]) % 2)
        out = {"episode": ep, "done": True, "reward": r}
    with lock:
        print(json.dumps(out), flush=True)
for line in sys.stdin:
    m = json.loads(line)
    if m["type"] == "step":
        threading.Thread(target=answer, args=(m,)).start()
PY
cat > bench.toml <<EOF
[job]
name = "bench-episodes"
seed = 7
steps = ${STEPS:-4}
output_dir = "out"
[model]
init = "random"
config = "$root/deploy/examples/tiny-llama.json"
dtype = "float32"
[data]
source = "generate"
format = "prompts"
train = ["data/arith-sft.jsonl"]
tokenizer = "bytes"
max_tokens = 2048
[batch]
docs_per_step = 32
[objective]
kind = "pg"
[rl]
group_size = 4
max_staleness = 0
[rl.sampling]
temperature = 1.0
max_new_tokens = ${NEW_TOKENS:-48}
[rl.env]
kind = "command"
command = ["python3", "env.py"]
env = ["SLOW_S", "P_SLOW", "TURNS"]
max_turns = $(( ${TURNS:-3} + 1 ))
max_episode_tokens = 1024
[rl.verifier]
kind = "exact"
[optimizer]
kind = "adamw"
lr = 1e-4
[parallel]
sharding = "ddp"
min_workers = 1
max_workers = 8
[checkpoint]
every_steps = 0
EOF
export SLOW_S="${SLOW_S:-1.0}" P_SLOW="${P_SLOW:-0.05}" TURNS="${TURNS:-3}"
start=$(date +%s.%N)
"$bin/accrue" local bench.toml --workers "${WORKERS:-2}" >/dev/null 2>"$work/err" || { cat "$work/err" >&2; exit 1; }
end=$(date +%s.%N)
python3 - "$start" "$end" <<'PY'
import json, sys
steps = [json.loads(l) for l in open("out/metrics.jsonl")]
steps = [s for s in steps if "step" in s and "eval" not in s]
x = [s["extra"] for s in steps if "rl/gen_seconds" in s["extra"]]
print(json.dumps({
    "wall_s": round(float(sys.argv[2]) - float(sys.argv[1]), 2),
    "steps": len(steps),
    "gen_seconds": round(sum(e["rl/gen_seconds"] for e in x), 2),
    "turns_mean": round(sum(e["rl/turns_mean"] for e in x) / max(len(x), 1), 2),
}))
PY
