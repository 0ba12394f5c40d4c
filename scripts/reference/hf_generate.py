"""Greedy completions from transformers' `generate` (KV cache), the
reference of the worker's generation (worker/tests/generate.rs).

usage: hf_generate.py MODEL_DIR PROMPTS.safetensors MAX_NEW_TOKENS OUT.safetensors
PROMPTS holds prompt{i} (int64 token ids); OUT gets completion{i} (int64,
the new tokens only). Each prompt is generated on its own (batch 1, no
padding), float32, `do_sample=False`, no EOS (exactly MAX_NEW_TOKENS).
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
    model_dir, prompts, max_new, out = sys.argv[1:5]
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    # No stop token: every completion runs to MAX_NEW_TOKENS.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    res = {}
    with torch.no_grad():
        for key, ids in load_file(prompts).items():
            n = int(max_new)
            seq = model.generate(
                input_ids=ids[None], attention_mask=torch.ones_like(ids[None]),
                do_sample=False, max_new_tokens=n, use_cache=True,
            )[0]
            res[key.replace("prompt", "completion")] = seq[ids.numel():].contiguous()
    save_file(res, out)


if __name__ == "__main__":
    main()
