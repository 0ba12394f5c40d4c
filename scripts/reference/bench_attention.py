"""torch SDPA beside `bench_attention` (worker/tests/bench.rs): one
attention layer's forward + backward over one document of T tokens, 4 query
heads over 1 kv head of 64, fp32, 2 threads; seconds and peak RSS growth.

    bench_attention.py T gqa|repeat

`gqa`: `scaled_dot_product_attention(enable_gqa=True)`; `repeat`: k/v
repeated per query group first, as transformers' `repeat_kv` does.
"""
import json
import sys
import time

import torch


def rss():
    f = {l.split(":")[0]: int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(("VmRSS", "VmHWM"))}
    return f["VmRSS"], f["VmHWM"]


def main():
    t, mode = int(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(2)
    torch.manual_seed(0)
    heads, kv, d = 4, 1, 64
    q = torch.randn(1, heads, t, d, requires_grad=True)
    k = torch.randn(1, kv, t, d, requires_grad=True)
    v = torch.randn(1, kv, t, d, requires_grad=True)
    g = torch.randn(1, heads, t, d)
    base, _ = rss()
    start = time.perf_counter()
    if mode == "gqa":
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        rep = heads // kv
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    fwd = time.perf_counter() - start
    (out * g).sum().backward()
    secs = time.perf_counter() - start
    _, peak = rss()
    print(json.dumps({"attention": f"torch-sdpa-{mode}", "T": t, "heads": heads, "kv_heads": kv,
                      "head_dim": d, "forward_s": round(fwd, 3), "seconds": round(secs, 3),
                      "peak_extra_mib": round((peak - base) / 2**20, 1),
                      "dk_abs_sum": float(k.grad.abs().sum())}))


if __name__ == "__main__":
    main()
