"""Loads an Accrue checkpoint directory with transformers and scores one
token sequence, to show the checkpoint is a working Hugging Face model.

usage: load_checkpoint.py CHECKPOINT_DIR TOKEN_ID...
prints one JSON line: {"architectures", "params", "loss", "finite"}
"""
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _deps import ensure_transformers  # noqa: E402

ensure_transformers()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def main():
    model_dir = sys.argv[1]
    ids = torch.tensor([[int(t) for t in sys.argv[2:]]])
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    loss = float(out.loss)
    print(json.dumps({
        "architectures": model.config.architectures,
        "params": sum(p.numel() for p in model.parameters()),
        "loss": loss,
        "finite": math.isfinite(loss) and bool(torch.isfinite(out.logits).all()),
    }))


if __name__ == "__main__":
    main()
