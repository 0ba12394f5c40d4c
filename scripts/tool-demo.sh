#!/usr/bin/env bash
# Multi-turn, tool-using RL end to end (issue 36) on this machine's CPUs:
#  1. synthetic two-digit multiplication (`--task tool-arithmetic`): chat
#     traces that call the calculator, training questions, and held-out
#     questions from problems that never occur in training;
#  2. SFT of the tiny model on the traces (deploy/examples/tool-sft.toml,
#     SFT_STEPS, default 420): it learns the call format and to copy, not
#     yet reliably;
#  3. GRPO with the built-in calculator as the environment
#     (deploy/examples/tool-rl.toml): each episode is the question, the
#     policy's turn with its <tool_call>, the tool's result (rendered by
#     the chat template, never trained on), the policy's answer; the
#     exact-match verifier scores the answer. The held-out questions are
#     answered greedily, with the same tool, before the first GRPO step
#     and after the last: `rl/accuracy` of the eval lines.
# The last stdout line is one JSON object:
#   {"accuracy_before", "accuracy_after", "tool_calls_per_episode", "wall_s", …}
# BIN=dir picks the binaries (default target/debug, built by setup.sh);
# SFT_STEPS / RL_STEPS / RL_LR override the recipe; WORKERS=n runs n workers.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
if [[ -z "${BIN:-}" ]]; then
  scripts/setup.sh >&2
  BIN=target/debug
fi
accrue="$BIN/accrue"
rm -rf runs/tool-sft runs/tool-rl runs/tool-sft.toml runs/tool-rl.toml
"$accrue" data synth --task tool-arithmetic --rows 4000 --seed 1 --out runs/data-tool >&2

sed "s/^steps = .*/steps = ${SFT_STEPS:-420}/" deploy/examples/tool-sft.toml > runs/tool-sft.toml
"$accrue" local runs/tool-sft.toml --workers "${WORKERS:-1}" >&2
ckpt=$(ls -d "$PWD"/runs/tool-sft/checkpoints/step-* | sort -V | tail -1)

# GRPO from the SFT checkpoint (weights only: a fresh optimizer, step 0).
steps="s/^//"
[[ -z "${RL_STEPS:-}" ]] || steps="s/^steps = .*/steps = $RL_STEPS/"
lr="s/^//"
[[ -z "${RL_LR:-}" ]] || lr="s/^lr = .*/lr = $RL_LR/"
sed -e "s#^init = .*#init = \"$ckpt\"\nresume = false#" -e "$steps" -e "$lr" \
    deploy/examples/tool-rl.toml > runs/tool-rl.toml
"$accrue" local runs/tool-rl.toml --workers "${WORKERS:-1}" >&2

end=$(date +%s)
python3 - "$((end - start))" <<'PY'
import json, sys
evals, steps = [], []
for line in open("runs/tool-rl/metrics.jsonl"):
    row = json.loads(line)
    if "eval" in row:
        evals.append(row["eval"])
    elif "step" in row:
        steps.append(row)
first, last = evals[0], evals[-1]
x = lambda e, k: e["extra"].get(k, 0.0)
rewards = [s["extra"]["rl/reward_mean"] for s in steps if "rl/reward_mean" in s["extra"]]
print(json.dumps({
    "accuracy_before": x(first, "rl/accuracy"),
    "accuracy_after": x(last, "rl/accuracy"),
    "tool_calls_per_episode": x(last, "rl/tool_calls_per_episode"),
    "turns_per_episode": x(last, "rl/turns_mean"),
    "eval_prompts": first["docs"],
    "grpo_steps": len(steps),
    "train_reward_first": rewards[0] if rewards else None,
    "train_reward_last": rewards[-1] if rewards else None,
    "wall_s": int(sys.argv[1]),
}))
PY
