"""PyTorch eager reference for the worker benchmark: one training step of
HF LlamaForCausalLM (same config, same packed tokens) with AdamW, 2 threads.

usage: bench_hf_step.py make-batch OUT.safetensors   (writes the shared batch)
       bench_hf_step.py run BATCH.safetensors [--mode packed|per-doc] [--steps N]
                        [--device cpu|cuda] [--attn sdpa|eager] [--dtype fp32|bf16]
       bench_hf_step.py optimizer BATCH.safetensors [--rounds N] [--device cpu|cuda]
Prints one JSON line: {"impl": ..., "tokens_per_s": ..., "step_s": ...}; the
optimizer command one line per round with the seconds of torch's optimizer
phase (clip_grad_norm_ and AdamW, both foreach) on the same model.
--dtype bf16 runs forward/backward under torch.autocast(bfloat16) with fp32
weights and optimizer state (the usual HF mixed precision).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _deps import ensure_transformers  # noqa: E402

ensure_transformers()

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
import transformers  # noqa: E402

CONFIG = dict(vocab_size=32000, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
              rms_norm_eps=1e-6, tie_word_embeddings=False)
if os.environ.get("ACCRUE_BENCH_LARGE") == "1":
    # A SmolLM2-135M shape (~135M parameters, tied embeddings).
    CONFIG = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, tie_word_embeddings=True)
# ACCRUE_BENCH_FAMILY: llama (default), qwen3 (per-head q/k norm, head_dim 64),
# olmo2, or qwen3_moe (Qwen3 attention, sparse MLPs on every layer).
FAMILY = os.environ.get("ACCRUE_BENCH_FAMILY", "llama")
FAMILY_EXTRA = {
    "llama": ("llama", "LlamaForCausalLM", {"hidden_act": "silu"}),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", {"hidden_act": "silu", "head_dim": 64}),
    "olmo2": ("olmo2", "Olmo2ForCausalLM", {"hidden_act": "silu"}),
    # Every layer sparse: 8 experts of 384, top 2 (the 135M shape: ~214M
    # parameters, ~95M active per token).
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM",
                  {"hidden_act": "silu", "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
                   "moe_intermediate_size": 384, "norm_topk_prob": True}),
}
if FAMILY not in FAMILY_EXTRA:
    raise SystemExit(f"ACCRUE_BENCH_FAMILY: {FAMILY} (one of {sorted(FAMILY_EXTRA)})")


def hf_config(**kw):
    model_type, _, extra = FAMILY_EXTRA[FAMILY]
    return transformers.AutoConfig.for_model(model_type, **CONFIG, **extra,
                                             rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}, **kw)


def hf_model(**kw):
    return transformers.AutoModelForCausalLM.from_config(hf_config(**kw))


# 16 documents, 4096 tokens, uneven lengths.
LENGTHS = [512, 128, 384, 256, 64, 448, 192, 320, 256, 128, 384, 96, 224, 352, 160, 192]
assert sum(LENGTHS) == 4096


def make_batch(out):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, CONFIG["vocab_size"], (sum(LENGTHS),), generator=g)
    cu = torch.tensor([0] + list(torch.tensor(LENGTHS).cumsum(0)), dtype=torch.int64)
    save_file({"input_ids": ids, "labels": ids.clone(), "cu_seq_lens": cu}, out)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(os.path.join(os.path.dirname(os.path.abspath(out)), "config.json"), "w") as f:
        model_type, arch, extra = FAMILY_EXTRA[FAMILY]
        json.dump({**CONFIG, **extra, "model_type": model_type, "architectures": [arch],
                   "initializer_range": 0.02,
                   "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}, f, indent=1)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run(batch, mode, steps, device="cpu", attn="sdpa", dtype="fp32"):
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = hf_model(attn_implementation=attn).float()
    model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    b = {k: v.to(device) for k, v in load_file(batch).items()}
    ids, labels, cu = b["input_ids"], b["labels"], b["cu_seq_lens"].tolist()
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=dtype == "bf16")
    total = sum(int((labels[s + 1:e] != -100).sum()) for s, e in zip(cu, cu[1:]))

    def step():
        if mode == "packed":
            pos = torch.cat([torch.arange(e - s) for s, e in zip(cu, cu[1:])]).to(device)
            lab = labels.clone()
            lab[torch.tensor(cu[1:-1])] = -100  # no prediction across documents
            with autocast:
                out = model(input_ids=ids[None], position_ids=pos[None], labels=lab[None])
            out.loss.backward()
        else:
            for s, e in zip(cu, cu[1:]):
                with autocast:
                    out = model(input_ids=ids[None, s:e], labels=labels[None, s:e])
                (out.loss * (e - s - 1) / total).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)

    step()  # warm-up
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    dt = (time.perf_counter() - t0) / steps
    name = f"pytorch-hf-{mode}" if device == "cpu" else f"pytorch-hf-{mode}-{attn}-{dtype}-{device}"
    print(json.dumps({"impl": name, "family": FAMILY, "params": sum(p.numel() for p in model.parameters()),
                      "tokens": len(ids), "step_s": dt,
                      "tokens_per_s": len(ids) / dt}))


def optimizer(rounds, device="cpu"):
    """torch's optimizer phase on the bench model: clip_grad_norm_ and
    AdamW, both foreach, on gradients of the model's shapes."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = hf_model().float().to(device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, foreach=True)
    numel = sum(p.numel() for p in params)
    for r in range(rounds + 1):
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        sync(device)
        t0 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        sync(device)
        dt = time.perf_counter() - t0
        if r > 0:  # round 0 warms up
            print(json.dumps({"phase": "optimizer", "impl": "torch-adamw-foreach", "params": numel,
                              "round": r, "s": dt}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=["make-batch", "run", "optimizer"])
    ap.add_argument("path")
    ap.add_argument("--mode", default="packed", choices=["packed", "per-doc"])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    a = ap.parse_args()
    if a.cmd == "make-batch":
        make_batch(a.path)
    elif a.cmd == "optimizer":
        optimizer(a.rounds, a.device)
    else:
        run(a.path, a.mode, a.steps, a.device, a.attn, a.dtype)


if __name__ == "__main__":
    main()
