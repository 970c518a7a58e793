"""Per layer boundary under tensor parallelism: all-reduce + add + RMSNorm + capture.

Three ways, for T in {1, 2, 4, ..., 2048} (H = 7168 bf16 by default):

  one-kernel   eagle_capture.symm one-shot kernel (all-reduce fused with add+RMSNorm+capture)
  nccl+fused   NCCL all-reduce, then eagle_capture.add_rmsnorm_capture
  symm+fused   torch's symm_mem one_shot_all_reduce, then eagle_capture.add_rmsnorm_capture

GPU microseconds per layer boundary from CUDA-graph replay (median), on every
rank; rank 0 prints the table, the crossover (smallest T from which
nccl+fused is faster than one-kernel) and writes JSON.

    torchrun --nproc-per-node 8 benchmarks/allreduce_capture.py --out results/
    python benchmarks/allreduce_capture.py      # world size 1: a smoke test only

NVLink multicast stays off (main() sets and checks the variables with
eagle_capture.symm.ensure_multicast_disabled before NCCL starts).
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from eagle_capture import symm
import eagle_capture as ec
from eagle_capture.bench import time_graph_replay


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden-size", type=int, default=7168)
    p.add_argument("--tokens", type=int, nargs="+", default=[2**i for i in range(12)])
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default=None, help="folder for allreduce_capture_w{W}.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("allreduce_capture: needs CUDA GPUs (one per rank)")
        return 0
    symm.ensure_multicast_disabled()  # before init_process_group: NCCL reads it then
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    import torch.distributed._symmetric_memory as symm_mem

    H, dtype, eps, T_max = args.hidden_size, torch.bfloat16, 1e-6, max(args.tokens)
    ar = symm.SymmAllReduceCapture(T_max, H, dtype, device=device)  # one-shot for every T
    torch_buf = symm_mem.empty(T_max, H, dtype=dtype, device=device)
    symm_mem.rendezvous(torch_buf, dist.group.WORLD)
    group_name = dist.group.WORLD.group_name
    weight = torch.ones(H, dtype=dtype, device=device)
    aux = torch.empty(T_max, 3, H, dtype=dtype, device=device)
    rows = []
    for T in args.tokens:
        partial = torch.randn(T, H, dtype=dtype, device=device)
        residual = torch.randn(T, H, dtype=dtype, device=device)

        def one_kernel():
            ar.reduce_add_rmsnorm(partial, residual, weight, eps, aux, 1)

        def nccl_fused():
            dist.all_reduce(partial)
            ec.add_rmsnorm_capture(partial, residual, weight, eps, aux, 1)

        def symm_fused():
            torch_buf[:T].copy_(partial)
            reduced = torch.ops.symm_mem.one_shot_all_reduce(torch_buf[:T], "sum", group_name)
            ec.add_rmsnorm_capture(reduced, residual, weight, eps, aux, 1)

        row = {"T": T}
        for name, fn in (("one_kernel", one_kernel), ("nccl_fused", nccl_fused),
                         ("symm_fused", symm_fused)):
            dist.barrier()
            try:
                row[name] = time_graph_replay([fn], 10, args.replays)
            except Exception as exc:  # report the path that cannot run here, keep going
                row[name] = None
                row[name + "_error"] = f"{type(exc).__name__}: {exc}"[:200]
        rows.append(row)
    if rank == 0:
        print(f"world size {world}, H = {H}, bf16; us per layer boundary, graph replay median")
        print(f"{'T':>6} {'one-kernel':>11} {'nccl+fused':>11} {'symm+fused':>11}")
        for r in rows:
            cells = [f"{r[k]:11.1f}" if r[k] is not None else f"{'err':>11}"
                     for k in ("one_kernel", "nccl_fused", "symm_fused")]
            print(f"{r['T']:>6} " + " ".join(cells))
        for r in rows:
            for k in ("one_kernel", "nccl_fused", "symm_fused"):
                if r.get(k + "_error"):
                    print(f"  T={r['T']} {k}: {r[k + '_error']}")
        crossover = next((r["T"] for r in rows if r["one_kernel"] and r["nccl_fused"]
                          and r["nccl_fused"] < r["one_kernel"]), None)
        print(f"crossover (nccl+fused faster from T =): {crossover}")
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"allreduce_capture_w{world}.json"), "w") as f:
                json.dump({"world_size": world, "hidden_size": H, "rows": rows,
                           "crossover_T": crossover, "device": torch.cuda.get_device_name(),
                           "torch": torch.__version__,
                           "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                           "command": " ".join(sys.argv)}, f, indent=1)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
