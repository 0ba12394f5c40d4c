"""Hugging Face side of scripts/bench_generate.sh: a random small Llama
saved as a checkpoint, and the tokens/s of transformers' `generate`
(greedy, KV cache) over a batch of prompts of different lengths.

usage: bench_hf_generate.py make DIR [--batch B] [--max-new N]
         writes DIR/model (HF checkpoint) and DIR/prompts.safetensors
       bench_hf_generate.py run DIR MAX_NEW
         prints one JSON line {"impl", "tokens", "seconds", "tokens_per_s"}
Prompts are left-padded into one batch (HF's way of batching generation);
every sequence runs to MAX_NEW new tokens (no EOS).
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _deps import ensure_transformers  # noqa: E402

ensure_transformers()

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

LENGTHS = [17, 64, 5, 33, 48, 9, 26, 40]


def make(out, batch):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
        rms_norm_eps=1e-6, initializer_range=0.05, tie_word_embeddings=False,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(os.path.join(out, "model"))
    g = torch.Generator().manual_seed(1)
    prompts = {
        f"prompt{i}": torch.randint(1, 8192, (LENGTHS[i % len(LENGTHS)],), generator=g)
        for i in range(batch)
    }
    save_file(prompts, os.path.join(out, "prompts.safetensors"))


def run(out, max_new):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.join(out, "model"), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    prompts = load_file(os.path.join(out, "prompts.safetensors"))
    prompts = [prompts[f"prompt{i}"] for i in range(len(prompts))]
    width = max(p.numel() for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.numel():] = p
        mask[i, width - p.numel():] = 1
    with torch.no_grad():
        model.generate(input_ids=ids[:1, -4:], attention_mask=mask[:1, -4:],
                       do_sample=False, max_new_tokens=2)  # warm-up
        start = time.perf_counter()
        seq = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=max_new, use_cache=True)
        seconds = time.perf_counter() - start
    tokens = (seq.shape[1] - width) * len(prompts)
    print(json.dumps({"impl": "hf-generate", "tokens": tokens, "seconds": seconds,
                      "tokens_per_s": tokens / seconds}))


if __name__ == "__main__":
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    if sys.argv[1] == "make":
        batch = int(sys.argv[sys.argv.index("--batch") + 1]) if "--batch" in sys.argv else 8
        make(sys.argv[2], batch)
    else:
        run(sys.argv[2], int(sys.argv[3]))
