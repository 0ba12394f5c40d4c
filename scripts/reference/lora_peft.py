"""Reference for the worker's LoRA: PEFT (peft from PyPI, pinned in
_deps.py) on the tiny transformers model of make_tiny_llama.py.

It wraps the model with `get_peft_model(LoraConfig(...))`, gives every
adapter a non-zero B (normal(0, 0.02) from --seed; A keeps PEFT's
Kaiming-uniform init from the same seed) so every LoRA weight gets a
gradient from step 1, saves that adapter with `save_pretrained` into
OUT/init (what the Accrue job starts from, `lora.init`), then trains
--steps steps and writes every adapter weight after each step.

Objectives (one step = every document or pair of the reference file):
- sft: Σ per-document NLL (each document through the model alone) /
  total loss tokens;
- dpo: pairs (doc 2i chosen, doc 2i+1 rejected), each sequence's log-prob
  summed over its loss tokens, the reference the base model with the
  adapters disabled (`disable_adapter()`), DPO's sigmoid loss
  -logsigmoid(beta·((pc - rc) - (pr - rr))) averaged over the pairs.
Then clip_grad_norm_ over the adapters and torch.optim.AdamW over the
adapters (weight decay on all of them: no adapter name contains a
--no-decay pattern).

usage: lora_peft.py MODEL_DIR REFERENCE.safetensors OUT_DIR
       [--objective sft|dpo] [--targets all-linear|q_proj,v_proj]
       [--rank 4] [--alpha 8] [--rslora] [--steps 3] [--lr 1e-2]
       [--wd 0.1] [--eps 1e-6] [--betas 0.9 0.95] [--clip 1.0]
       [--beta 0.1] [--seed 0]
writes OUT_DIR/init (a PEFT adapter folder) and OUT_DIR/steps.safetensors
with step{k}.{name} and the first step's gradients grad.{name} (names as
Accrue's variables: model.layers.0.self_attn.q_proj.lora_A.weight); prints
one JSON line with the loss of every step.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _deps import ensure_peft  # noqa: E402

ensure_peft()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

PREFIX = "base_model.model."


def ours(name):
    """A PEFT parameter name as Accrue names the variable."""
    return name[len(PREFIX):].replace(".default.", ".")


def seq_logp(model, ids, labels):
    logits = model(input_ids=ids[None]).logits[0]
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    tgt = labels[1:]
    mask = tgt != -100
    return lp[mask].gather(1, tgt[mask][:, None]).sum()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("reference")
    ap.add_argument("out")
    ap.add_argument("--objective", default="sft", choices=["sft", "dpo"])
    ap.add_argument("--targets", default="all-linear")
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--alpha", type=float, default=8.0)
    ap.add_argument("--rslora", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--eps", type=float, default=1e-6)
    ap.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.95])
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    cfg = LoraConfig(r=args.rank, lora_alpha=args.alpha, lora_dropout=0.0,
                     target_modules=targets, use_rslora=args.rslora, task_type="CAUSAL_LM")
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained(os.path.join(args.out, "init"))
    model.train()

    ref = load_file(args.reference)
    docs = []
    i = 0
    while f"doc{i}.input_ids" in ref:
        docs.append((ref[f"doc{i}.input_ids"], ref[f"doc{i}.labels"]))
        i += 1
    total = sum(int((l[1:] != -100).sum()) for _, l in docs)
    pairs = [(docs[2 * k], docs[2 * k + 1]) for k in range(len(docs) // 2)]
    ref_logps = []
    if args.objective == "dpo":
        with torch.no_grad(), model.disable_adapter():
            for c, r in pairs:
                ref_logps.append((seq_logp(model, *c).item(), seq_logp(model, *r).item()))

    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in trainable], lr=args.lr, betas=tuple(args.betas),
                            eps=args.eps, weight_decay=args.wd)
    out, losses = {}, []
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        loss_sum = 0.0
        if args.objective == "sft":
            for ids, labels in docs:
                logits = model(input_ids=ids[None]).logits[0]
                nll = F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100,
                                      reduction="sum")
                (nll / total).backward()
                loss_sum += nll.item()
            losses.append(loss_sum / total)
        else:
            for (c, r), (rc, rr) in zip(pairs, ref_logps):
                pc = seq_logp(model, *c)
                pr = seq_logp(model, *r)
                loss = -F.logsigmoid(args.beta * ((pc - rc) - (pr - rr)))
                (loss / len(pairs)).backward()
                loss_sum += loss.item()
            losses.append(loss_sum / len(pairs))
        if step == 1:
            for name, p in trainable:
                out[f"grad.{ours(name)}"] = p.grad.detach().clone().contiguous()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_([p for _, p in trainable], args.clip)
        opt.step()
        for name, p in trainable:
            out[f"step{step}.{ours(name)}"] = p.detach().clone().contiguous()
    save_file(out, os.path.join(args.out, "steps.safetensors"))
    print(json.dumps({"losses": losses, "adapters": len(trainable), "docs": len(docs),
                      "pairs": len(pairs)}))


if __name__ == "__main__":
    main()
