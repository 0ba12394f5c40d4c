"""torch.distributed (gloo) reference for `accrue bench collective`: one rank
of all_reduce / reduce_scatter / all_gather timings on float32 buffers, on
127.0.0.1, with the same sizes and iteration counts as the Rust ring.

The bench runs one process per rank:
  bench_gloo.py --rank R --world N --port P --sizes-mib 1,16,64
and reads one JSON line per (op, size) from each: {"op", "bytes", "world",
"rank", "iters", "secs_per_iter"}.
"""
import argparse
import json
import sys
import time
import warnings

import torch
import torch.distributed as dist


def iters_for(nbytes):
    """Must match accrue's bench: ~256 MiB moved per timing, 5..50 iterations."""
    return max(5, min(50, (256 << 20) // max(nbytes, 1)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--sizes-mib", default="1,16,64")
    a = ap.parse_args()
    torch.set_num_threads(1)
    # reduce_scatter_tensor / all_gather_into_tensor are deprecated aliases.
    warnings.filterwarnings("ignore", category=FutureWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}",
                            rank=a.rank, world_size=a.world)
    n = a.world
    for mib in [float(s) for s in a.sizes_mib.split(",")]:
        nbytes = int(mib * (1 << 20))
        elems = (nbytes // 4) // n * n  # equal shards (gloo's tensor ops need them)
        buf = torch.ones(elems, dtype=torch.float32)
        shard = torch.ones(elems // n, dtype=torch.float32)

        def all_reduce():
            dist.all_reduce(buf)

        def reduce_scatter():
            dist.reduce_scatter_tensor(shard, buf)

        def all_gather():
            dist.all_gather_into_tensor(buf, shard)

        for name, f in [("all_reduce", all_reduce), ("reduce_scatter", reduce_scatter),
                        ("all_gather", all_gather)]:
            it = iters_for(nbytes)
            try:
                for _ in range(2):
                    f()
            except (RuntimeError, NotImplementedError) as e:
                print(json.dumps({"op": name, "bytes": elems * 4, "world": n, "rank": a.rank,
                                  "error": str(e).splitlines()[0]}), flush=True)
                continue
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(it):
                f()
            dt = (time.perf_counter() - t0) / it
            print(json.dumps({"op": name, "bytes": elems * 4, "world": n, "rank": a.rank,
                              "iters": it, "secs_per_iter": dt}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
