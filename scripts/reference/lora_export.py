"""Checks an exported LoRA adapter and merged model against PEFT.

Loads BASE_DIR with transformers, the adapter folder ADAPTER_DIR with
`PeftModel.from_pretrained`, scores the token ids with it, then
`merge_and_unload()` and compares every merged weight with the folder
MERGED_DIR that `accrue export --merge` wrote (loaded with transformers).

usage: lora_export.py BASE_DIR ADAPTER_DIR MERGED_DIR OUT.safetensors TOKEN_ID...
writes OUT with "peft.logits" (the adapter model's) and "merged.logits"
(the exported merged folder's); prints one JSON line with the largest
weight difference between PEFT's merge and the exported one.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _deps import ensure_peft  # noqa: E402

ensure_peft()

import torch  # noqa: E402
from peft import PeftModel  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402


def main():
    base_dir, adapter_dir, merged_dir, out = sys.argv[1:5]
    ids = torch.tensor([[int(t) for t in sys.argv[5:]]])
    torch.set_num_threads(2)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter_dir)
    model.eval()
    with torch.no_grad():
        peft_logits = model(input_ids=ids).logits[0]
    theirs = model.merge_and_unload().state_dict()
    exported = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
    exported.eval()
    with torch.no_grad():
        merged_logits = exported(input_ids=ids).logits[0]
    worst, name = 0.0, ""
    for k, v in exported.state_dict().items():
        d = float((v - theirs[k]).abs().max())
        if d > worst:
            worst, name = d, k
    save_file({"peft.logits": peft_logits.contiguous(),
               "merged.logits": merged_logits.contiguous()}, out)
    print(json.dumps({"worst_weight_diff": worst, "worst": name,
                      "tensors": len(theirs)}))


if __name__ == "__main__":
    main()
