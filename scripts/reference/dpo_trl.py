"""DPO reference by TRL's own loss code: runs `trl.DPOTrainer._compute_loss`
(TRL 1.16.0, installed into the venv if missing) on a tiny Hugging Face model
with precomputed reference log-probs, and reports the loss, TRL's logged
reward metrics and the gradient of every parameter.

TRL's `_compute_loss` is called unbound on a minimal stand-in for the trainer
(the attributes it reads: beta, loss types, precomputed-reference flag, a
pass-through accelerator, the metrics dict), so the loss, rewards, accuracy,
margins and logps are exactly TRL's code, including its fused LM head
(`add_fused_lm_head`, as `DPOTrainer.__init__` installs it). The batch is
TRL's layout: all chosen rows, then all rejected rows, right-padded, with
`completion_mask` = the positions whose label is not -100.

It also scores every sequence ALONE (no padding, no packing) with the plain
transformers forward, as the unpacked per-sequence log-probs.

usage: dpo_trl.py MODEL_DIR PAIRS_JSON GRADS_OUT
  PAIRS_JSON: {"loss_type": "sigmoid"|"ipo"|"sigmoid_norm", "beta": float,
               "pairs": [{"chosen_ids", "chosen_labels", "rejected_ids",
                          "rejected_labels", "ref_chosen", "ref_rejected"}]}
prints one JSON line: {"loss", "metrics": {name: mean over pairs},
  "chosen_logps", "rejected_logps" (TRL's, per pair), "alone_logps"
  (per pair [chosen, rejected], each sequence run alone)}; writes
  "grad.<hf name>" tensors to GRADS_OUT (safetensors).
"""
import importlib
import json
import os
import subprocess
import sys
from collections import defaultdict
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(__file__))
from _deps import TRANSFORMERS, ensure_transformers, install_lock  # noqa: E402

TRL = "trl==1.16.0"


def ensure_trl():
    try:
        trl = importlib.import_module("trl")
        if trl.__version__ == TRL.split("==")[1]:
            return
    except ImportError:
        pass
    # Pin torch and transformers too, so TRL's requirements cannot move them.
    pins = [TRL, "torch==2.13.0", TRANSFORMERS]
    with install_lock():
        subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *pins])


ensure_transformers()
ensure_trl()

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import DPOTrainer  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402


def trl_stand_in(model, loss_type, beta):
    """The attributes `DPOTrainer._compute_loss` reads, as `__init__` sets
    them for `DPOConfig(loss_type=[loss_type], beta=beta,
    precompute_ref_log_probs=True)` on one process."""
    ident = lambda x: x  # noqa: E731
    return SimpleNamespace(
        model=model,
        ref_model=None,
        accelerator=SimpleNamespace(
            device=torch.device("cpu"), gather=ident, gather_for_metrics=ident
        ),
        aux_loss_enabled=False,
        precompute_ref_logps=True,
        ld_alpha=None,
        f_divergence_type="reverse_kl",
        loss_types=[loss_type],
        loss_weights=[1.0],
        beta=beta,
        label_smoothing=0.0,
        use_weighting=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _total_train_tokens=0,
        _tp_size=1,
    )


def padded(rows, fill):
    width = max(len(r) for r in rows)
    return torch.tensor([r + [fill] * (width - len(r)) for r in rows])


def main():
    model_dir, pairs_path, grads_out = sys.argv[1:4]
    torch.set_num_threads(2)
    spec = json.load(open(pairs_path))
    pairs = spec["pairs"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()  # no dropout in the tiny Llama; "train" picks TRL's metrics dict

    # Unpacked, unpadded per-sequence log-probs with the plain forward.
    alone = []
    with torch.no_grad():
        for p in pairs:
            both = []
            for role in ("chosen", "rejected"):
                ids = torch.tensor([p[f"{role}_ids"]])
                labels = torch.tensor(p[f"{role}_labels"][1:])
                logits = model(input_ids=ids).logits[0, :-1].double()
                lp = logits.log_softmax(-1)
                keep = labels != -100
                both.append(float(lp[keep].gather(1, labels[keep, None]).sum()))
            alone.append(both)

    add_fused_lm_head(model, outputs=("log_probs", "entropy", "mean_logits", "is_top1"))
    ids = [p["chosen_ids"] for p in pairs] + [p["rejected_ids"] for p in pairs]
    labels = [p["chosen_labels"] for p in pairs] + [p["rejected_labels"] for p in pairs]
    inputs = {
        "input_ids": padded(ids, 0),
        "attention_mask": padded([[1] * len(r) for r in ids], 0),
        "completion_mask": padded([[int(x != -100) for x in r] for r in labels], 0),
        "ref_chosen_logps": torch.tensor([p["ref_chosen"] for p in pairs]),
        "ref_rejected_logps": torch.tensor([p["ref_rejected"] for p in pairs]),
    }
    # The labels TRL derives from completion_mask are ours.
    derived = inputs["input_ids"].masked_fill(inputs["completion_mask"] == 0, -100)
    assert derived.tolist() == padded(labels, -100).tolist(), "labels are not ids masked by -100"

    stand_in = trl_stand_in(model, spec["loss_type"], spec["beta"])
    model.zero_grad()
    loss = DPOTrainer._compute_loss(stand_in, model, inputs, False)
    loss.backward()
    grads = {f"grad.{n}": p.grad.detach().contiguous() for n, p in model.named_parameters()}
    save_file(grads, grads_out)

    # TRL's per-pair policy logps (the same fused forward, no grad).
    with torch.no_grad():
        out = model(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            labels=derived,
            fused_lm_head=True,
        )
        logps = out.log_probs.sum(dim=1).tolist()
    m = stand_in._metrics["train"]
    keys = [
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
    ]
    print(json.dumps({
        "loss": loss.item(),
        "metrics": {k: m[k][-1] for k in keys},
        "chosen_logps": logps[: len(pairs)],
        "rejected_logps": logps[len(pairs):],
        "alone_logps": alone,
    }))


if __name__ == "__main__":
    main()
