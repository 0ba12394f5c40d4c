"""Loads a checkpoint directory with transformers.AutoModelForCausalLM and
writes the logits of each document in an input safetensors file.

usage: hf_logits.py MODEL_DIR INPUTS.safetensors OUT.safetensors
INPUTS holds doc{i}.input_ids (int64); OUT gets doc{i}.logits (float32).
"""
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _deps import ensure_transformers  # noqa: E402

ensure_transformers()

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def main():
    model_dir, inputs, out = sys.argv[1:4]
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    docs = load_file(inputs)
    res = {}
    with torch.no_grad():
        for key, ids in docs.items():
            name = key.removesuffix(".input_ids")
            res[f"{name}.logits"] = model(input_ids=ids[None]).logits[0].float().contiguous()
    save_file(res, out)


if __name__ == "__main__":
    main()
