"""Reference for the worker's AdamW with weight-decay groups: trains the
tiny HF model of make_tiny_llama.py for a few steps on its documents
(each step: every document through transformers separately, Σ NLL / total
loss tokens, clip_grad_norm_, then torch.optim.AdamW with two parameter
groups: names containing a --no-decay substring take weight_decay 0, the
rest --wd) and writes the parameters after every step.

usage: adamw_groups.py MODEL_DIR REFERENCE.safetensors OUT.safetensors
       [--steps 3] [--lr 1e-2] [--wd 0.1] [--eps 1e-8] [--betas 0.9 0.95]
       [--clip 1.0] [--no-decay bias,norm] [--foreach]
writes OUT with step{k}.{name} for k = 1..steps
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _deps import ensure_transformers  # noqa: E402

ensure_transformers()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def hub_names(name, t):
    """A parameter under its checkpoint name(s): transformers 5 holds a
    MoE layer's experts fused (`experts.gate_up_proj` [E, 2I, H],
    `experts.down_proj` [E, H, I]); checkpoints name one linear per expert."""
    if name.endswith("mlp.experts.gate_up_proj"):
        inter = t.shape[1] // 2
        base = name[: -len("gate_up_proj")]
        for e in range(t.shape[0]):
            yield f"{base}{e}.gate_proj.weight", t[e, :inter]
            yield f"{base}{e}.up_proj.weight", t[e, inter:]
    elif name.endswith("mlp.experts.down_proj"):
        base = name[: -len("down_proj")]
        for e in range(t.shape[0]):
            yield f"{base}{e}.down_proj.weight", t[e]
    else:
        yield name, t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("reference")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--eps", type=float, default=1e-8)
    ap.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.95])
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--no-decay", default="bias,norm")
    ap.add_argument("--foreach", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.train()
    ref = load_file(args.reference)
    docs = []
    i = 0
    while f"doc{i}.input_ids" in ref:
        docs.append((ref[f"doc{i}.input_ids"], ref[f"doc{i}.labels"]))
        i += 1
    total = sum(int((l[1:] != -100).sum()) for _, l in docs)
    patterns = [p for p in args.no_decay.split(",") if p]
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if any(s in name for s in patterns) else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": args.wd},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=tuple(args.betas), eps=args.eps,
                            foreach=args.foreach)
    out = {}
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        for ids, labels in docs:
            logits = model(input_ids=ids[None]).logits[0]
            nll = F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
            (nll / total).backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        for name, p in model.named_parameters():
            for key, t in hub_names(name, p.detach()):
                out[f"step{step}.{key}"] = t.clone().contiguous()
    save_file(out, args.out)
    print(json.dumps({"steps": args.steps, "decay": len(decay), "no_decay": len(no_decay)}))


if __name__ == "__main__":
    main()
