"""Parity reference for the worker's Llama: builds a tiny random HF model,
saves it with save_pretrained, and writes per-document logits, summed NLL
(HF label semantics) and the gradients of (sum of NLL over documents) /
(total loss tokens), each document run separately through transformers.

usage: make_tiny_llama.py OUT_DIR [--variant llama|qwen2|tied|sharded|qwen3|qwen3_moe|qwen3_moe_aux|olmo2|mistral|gemma3|gemma3_softcap] [--seed N]
(`sharded`: the llama variant saved as several model-0000i-of-0000n.safetensors
files plus model.safetensors.index.json; `qwen3_moe_aux`: Qwen3-MoE with the
load-balancing loss on (`output_router_logits`), whose gradients are those
of HF's own loss over ONE padded batch of every document: the cross-entropy
mean over the batch's loss tokens plus router_aux_loss_coef times the
auxiliary loss over every token of the batch. Experts' gradients are
written under the hub names, `experts.{e}.{gate,up,down}_proj.weight`.)
writes OUT_DIR/model/{config.json,model.safetensors} and OUT_DIR/reference.safetensors
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
from safetensors.torch import save_file  # noqa: E402
import transformers  # noqa: E402

# (length, number of leading prompt tokens masked with -100)
DOCS = [(17, 3), (5, 0), (33, 10), (1, 0), (12, 2), (24, 0)]


def build(variant, seed):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, initializer_range=0.05,
    )
    if variant in ("llama", "sharded"):
        cfg = transformers.LlamaConfig(tie_word_embeddings=False,
                                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                                       rope_theta=500000.0, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif variant == "tied":
        cfg = transformers.LlamaConfig(tie_word_embeddings=True, **common)
        model = transformers.LlamaForCausalLM(cfg)
    elif variant == "qwen2":
        cfg = transformers.Qwen2Config(tie_word_embeddings=False, use_sliding_window=False, **common)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random non-zero biases so they are checked
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0.0, 0.05)
    elif variant == "qwen3":
        cfg = transformers.Qwen3Config(tie_word_embeddings=False, head_dim=24, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    elif variant == "gemma3_softcap":
        # The final-logit soft-cap configured (Gemma 3 releases leave it
        # null), small enough to bend every logit. (transformers' Gemma 3
        # attention takes no soft-cap, so attn_logit_softcapping is not set.)
        cfg = transformers.Gemma3TextConfig(
            head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=1.0, attn_logit_softcapping=None,
            pad_token_id=0, **common)
        model = transformers.Gemma3ForCausalLM(cfg)
    elif variant in ("qwen3_moe", "qwen3_moe_aux"):
        # Layer 0 dense (mlp_only_layers), layer 1 sparse: both kinds checked.
        cfg = transformers.Qwen3MoeConfig(
            tie_word_embeddings=False, head_dim=24, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=True,
            output_router_logits=variant == "qwen3_moe_aux", router_aux_loss_coef=0.25, **common)
        model = transformers.Qwen3MoeForCausalLM(cfg)
    elif variant == "olmo2":
        cfg = transformers.Olmo2Config(tie_word_embeddings=False, **common)
        model = transformers.Olmo2ForCausalLM(cfg)
    elif variant == "mistral":
        cfg = transformers.MistralConfig(tie_word_embeddings=False, sliding_window=8, **common)
        model = transformers.MistralForCausalLM(cfg)
    elif variant == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}},
            pad_token_id=0, **common)
        model = transformers.Gemma3ForCausalLM(cfg)
    else:
        raise SystemExit(f"unknown variant {variant}")
    if variant in ("qwen3", "qwen3_moe", "qwen3_moe_aux", "olmo2", "mistral", "gemma3", "gemma3_softcap"):
        with torch.no_grad():  # norms away from their init so each is checked
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * 0.1)
    return model.float()


def grads_out(model, out):
    """Every parameter's gradient under its checkpoint name (fused experts
    split into the hub's per-expert linears)."""
    for name, p in model.named_parameters():
        g = p.grad.detach()
        if name.endswith("mlp.experts.gate_up_proj"):
            inter = g.shape[1] // 2
            for e in range(g.shape[0]):
                base = name[: -len("gate_up_proj")] + f"{e}."
                out[f"grad.{base}gate_proj.weight"] = g[e, :inter].clone().contiguous()
                out[f"grad.{base}up_proj.weight"] = g[e, inter:].clone().contiguous()
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(g.shape[0]):
                base = name[: -len("down_proj")] + f"{e}."
                out[f"grad.{base}down_proj.weight"] = g[e].clone().contiguous()
        else:
            out[f"grad.{name}"] = g.clone().contiguous()


def batch_reference(model, docs, out, total):
    """HF's own loss over one right-padded batch of every document."""
    n = max(len(ids) for ids, _ in docs)
    ids = torch.zeros(len(docs), n, dtype=torch.long)
    labels = torch.full((len(docs), n), -100, dtype=torch.long)
    mask = torch.zeros(len(docs), n, dtype=torch.long)
    for i, (d, l) in enumerate(docs):
        ids[i, : len(d)] = d
        labels[i, : len(d)] = l
        mask[i, : len(d)] = 1
    model.zero_grad()
    res = model(input_ids=ids, attention_mask=mask, labels=labels)
    res.loss.backward()
    grads_out(model, out)
    out["loss"] = res.loss.detach().reshape(1).double()
    out["aux_loss"] = res.aux_loss.detach().reshape(1).double()
    out["total_loss_tokens"] = torch.tensor([total], dtype=torch.int64)
    print(json.dumps({"docs": len(docs), "loss_tokens": total, "loss": res.loss.item(),
                      "aux_loss": res.aux_loss.item()}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--variant", default="llama")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = build(args.variant, args.seed)
    shard = {"max_shard_size": "100KB"} if args.variant == "sharded" else {}
    model.save_pretrained(os.path.join(args.out, "model"), safe_serialization=True, **shard)
    gen = torch.Generator().manual_seed(args.seed + 1)
    out = {}
    docs = []
    for i, (n, masked) in enumerate(DOCS):
        ids = torch.randint(0, 300, (n,), generator=gen)
        labels = ids.clone()
        labels[:masked] = -100
        docs.append((ids, labels))
        out[f"doc{i}.input_ids"] = ids
        out[f"doc{i}.labels"] = labels
    total = sum(int((l[1:] != -100).sum()) for _, l in docs)
    if args.variant == "qwen3_moe_aux":
        batch_reference(model, docs, out, total)
        save_file(out, os.path.join(args.out, "reference.safetensors"))
        return
    model.zero_grad()
    objective = 0.0
    for i, (ids, labels) in enumerate(docs):
        res = model(input_ids=ids[None], labels=labels[None])
        logits = res.logits[0]
        nll = F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum")
        n_valid = int((labels[1:] != -100).sum())
        if n_valid > 0:  # HF's own loss is the mean over the shifted labels
            assert abs(res.loss.item() * n_valid - nll.item()) <= 1e-4 * max(1.0, nll.item()), (res.loss, nll)
        out[f"doc{i}.logits"] = logits.detach().contiguous()
        out[f"doc{i}.loss_sum"] = nll.detach().reshape(1).double()
        (nll / total).backward()
        objective += nll.item()
    grads_out(model, out)
    out["total_loss_tokens"] = torch.tensor([total], dtype=torch.int64)
    save_file(out, os.path.join(args.out, "reference.safetensors"))
    print(json.dumps({"docs": len(docs), "loss_tokens": total, "loss_mean": objective / total}))


if __name__ == "__main__":
    main()
