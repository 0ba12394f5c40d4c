"""Policy-gradient reference, written independently of the Rust worker: a
GRPO-style update over rollouts with plain PyTorch on the Hugging Face model
(transformers, installed into the venv if missing), each rollout run ALONE
(no packing, no padding), for several optimizer steps.

Per step:
- group-relative advantages from the step's rewards,
  `(r - mean_group) / (std_group + eps)` with the unbiased std (or centred
  only, `scale_by_std = false`);
- per completion token: `ratio = exp(logp - old_logp)` (on-policy
  `exp(logp - logp.detach())` when a rollout carries no old log-probs),
  surrogate `-min(ratio*A, clamp(ratio, 1-c, 1+c)*A)`, plus
  `kl_coef * (exp(ref - logp) - (ref - logp) - 1)` (k3) with `ref` the
  log-probs of a frozen copy of the INITIAL model;
- or, with `off_policy = "tis"`, verl's truncated importance sampling:
  the clipped surrogate against `logp.detach()` (ratio 1, gradient
  d logp) times `min(exp(logp.detach() - old_logp), tis_cap)`;
- the step's objective: Σ token losses / T (the step's completion tokens,
  "token"), Σ over rollouts of the rollout's token mean / rollouts
  ("sequence"), or Σ / constant ("constant");
- backward, `clip_grad_norm_`, `torch.optim.AdamW` step.

usage: pg_reference.py MODEL_DIR SPEC_JSON TENSORS_OUT
  SPEC_JSON: {"clip_ratio", "kl_coef", "norm": "token"|"sequence"|"constant",
              "off_policy": "clip"|"tis" (default clip), "tis_cap",
              "constant", "scale_by_std", "adv_eps",
              "optimizer": {"lr", "betas", "eps", "weight_decay", "grad_clip"},
              "steps": [[{"ids", "labels", "reward", "group",
                          "old_logprobs": null | [one per id; [j] = log-prob
                          of ids[j] given ids[:j]]}]]}
prints one JSON line: {"steps": [{"loss_sum", "objective", "loss_tokens",
  "advantage_sum" (Σ advantage × completion tokens), "clip_count", "kl_sum",
  "advantages", "grad_norm"}]}; writes "step{s}.grad.<hf name>" (before
  clipping) and "step{s}.param.<hf name>" (after the step) to TENSORS_OUT.
"""
import copy
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _deps import ensure_transformers  # noqa: E402

ensure_transformers()

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def advantages(rollouts, scale_by_std, eps):
    groups = {}
    for i, r in enumerate(rollouts):
        groups.setdefault(str(r["group"]), []).append(i)
    out = [0.0] * len(rollouts)
    for idx in groups.values():
        rewards = torch.tensor([float(rollouts[i]["reward"]) for i in idx], dtype=torch.float64)
        centred = rewards - rewards.mean()
        if scale_by_std:
            centred = centred / (rewards.std(unbiased=True) + eps)
        for i, a in zip(idx, centred.tolist()):
            out[i] = a
    return out


def completion_logps(model, ids, labels):
    """(log-prob of each next token in float64, mask of completion tokens)."""
    ids_t = torch.tensor([ids])
    logits = model(input_ids=ids_t).logits[0, :-1].float()
    target = torch.tensor(labels[1:])
    mask = target != -100
    safe = target.clamp_min(0)
    lp = logits.log_softmax(-1).gather(1, safe[:, None])[:, 0].double()
    return lp, mask


def step_loss(model, ref_model, rollouts, adv, spec):
    c = spec["clip_ratio"]
    kl_coef = spec["kl_coef"]
    total_tokens = sum(sum(1 for x in r["labels"][1:] if x != -100) for r in rollouts)
    objective = torch.zeros((), dtype=torch.float64)
    stats = dict(loss_sum=0.0, loss_tokens=0, advantage_sum=0.0, clip_count=0, kl_sum=0.0)
    for r, a in zip(rollouts, adv):
        lp, mask = completion_logps(model, r["ids"], r["labels"])
        lp = lp[mask]
        has_old = r.get("old_logprobs") is not None
        if has_old:
            old = torch.tensor(r["old_logprobs"][1:], dtype=torch.float64)[mask]
        if spec.get("off_policy") == "tis":
            # verl `compute_policy_loss_vanilla` with `tis_imp_ratio_cap`:
            # the PPO ratio against the trainer's own old_log_prob (the
            # current weights: one update per batch), the loss times the
            # truncated rollout ratio exp(old_log_prob - rollout), detached.
            old_log_prob = lp.detach()
            ratio = torch.exp(lp - old_log_prob)
            pg = torch.maximum(-ratio * a, -ratio.clamp(1 - c, 1 + c) * a)
            if has_old:
                tis = torch.exp(old_log_prob - old)
                token_loss = pg * tis.clamp(max=spec["tis_cap"])
                stats["clip_count"] += int((tis > spec["tis_cap"]).sum())
            else:
                token_loss = pg
            unclipped = clipped = torch.zeros_like(lp)
        else:
            ratio = torch.exp(lp - old) if has_old else torch.exp(lp - lp.detach())
            unclipped = ratio * a
            clipped = ratio.clamp(1 - c, 1 + c) * a
            token_loss = -torch.minimum(unclipped, clipped)
        kl = torch.zeros_like(lp)
        if kl_coef > 0:
            with torch.no_grad():
                ref, _ = completion_logps(ref_model, r["ids"], r["labels"])
            x = ref[mask] - lp
            kl = torch.exp(x) - x - 1
            token_loss = token_loss + kl_coef * kl
        n = int(mask.sum())
        if spec["norm"] == "token":
            objective = objective + token_loss.sum() / total_tokens
        elif spec["norm"] == "sequence":
            objective = objective + token_loss.sum() / n / len(rollouts)
        else:
            objective = objective + token_loss.sum() / spec["constant"]
        stats["loss_sum"] += float(token_loss.detach().sum())
        stats["loss_tokens"] += n
        stats["advantage_sum"] += a * n
        stats["clip_count"] += int((unclipped > clipped).sum())
        stats["kl_sum"] += float(kl.detach().sum())
    return objective, stats


def main():
    model_dir, spec_path, out_path = sys.argv[1:4]
    torch.set_num_threads(2)
    spec = json.load(open(spec_path))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()  # no dropout in the tiny Llama
    ref_model = copy.deepcopy(model).eval()
    for p in ref_model.parameters():
        p.requires_grad_(False)
    o = spec["optimizer"]
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=o["lr"],
        betas=tuple(o["betas"]),
        eps=o["eps"],
        weight_decay=o["weight_decay"],
    )
    tensors, steps = {}, []
    for s, rollouts in enumerate(spec["steps"]):
        adv = advantages(rollouts, spec["scale_by_std"], spec["adv_eps"])
        opt.zero_grad()
        objective, stats = step_loss(model, ref_model, rollouts, adv, spec)
        objective.backward()
        for n, p in model.named_parameters():
            tensors[f"step{s}.grad.{n}"] = p.grad.detach().clone().contiguous()
        max_norm = o["grad_clip"] if o["grad_clip"] > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        for n, p in model.named_parameters():
            tensors[f"step{s}.param.{n}"] = p.detach().clone().contiguous()
        stats.update(objective=float(objective.detach()), advantages=adv, grad_norm=float(norm))
        steps.append(stats)
    save_file(tensors, out_path)
    print(json.dumps({"steps": steps}))


if __name__ == "__main__":
    main()
