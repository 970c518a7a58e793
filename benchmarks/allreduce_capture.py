"""Per layer boundary under tensor parallelism: all-reduce + add + RMSNorm + capture.

Paths, for T in {1, 2, 4, ..., 2048} (H = 7168 bf16 by default), all in place
on the same tensors (the normed output overwrites the partial, the residual is
updated, the capture goes to slot 1 of a [T, 3, H] buffer):

  one-kernel    eagle_capture.parallel.symm one-shot Lamport kernel (all-reduce fused with add+RMSNorm+capture)
  one-kernel+wd the same with the opt-in watchdog on (only at --watchdog-tokens)
  one-kernel+tk the same with rows taken by ticket (rows_by_ticket; only at --watchdog-tokens)
  nccl+fused    NCCL all-reduce, then eagle_capture.add_rmsnorm_capture
  symm1+fused   torch symm_mem one_shot_all_reduce (+ staging copy), then the fused op
  symm2+fused   torch symm_mem two_shot_all_reduce_ (in place, + staging copy), then the fused op

GPU microseconds per layer boundary: median of --replays CUDA-graph replays of
--steps-per-graph calls each (the per-replay launch cost amortised), on every
rank; rank 0 prints the table, for each path the T ranges where it is the
fastest, the one-kernel speed-up over nccl+fused, the host time of an eager
call, and writes JSON. ``--write-table F`` writes the path table that
eagle_capture.parallel.symm.SymmAllReduceCapture(table=F) uses: one_shot or nccl per T,
whichever measured faster here.

    torchrun --nproc-per-node 2 benchmarks/allreduce_capture.py --out results/ --write-table t.json
    python benchmarks/allreduce_capture.py      # world size 1: a smoke test only

NVLink multicast stays off (main() sets and checks the variables with
eagle_capture.parallel.symm.ensure_multicast_disabled before NCCL starts).
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

import eagle_capture as ec
from eagle_capture.parallel import symm
from eagle_capture.parallel.paths import measured_table, write_table
from eagle_capture.testing.bench import host_us_per_call, time_graph_replay

PATHS = ("one_kernel", "one_kernel_wd", "one_kernel_tk", "nccl_fused", "symm1_fused", "symm2_fused")
LABELS = {
    "one_kernel": "one-kernel",
    "one_kernel_wd": "+watchdog",
    "one_kernel_tk": "+ticket",
    "nccl_fused": "nccl+fused",
    "symm1_fused": "symm1+fused",
    "symm2_fused": "symm2+fused",
}
# The one-kernel's opt-in variants: measured at --watchdog-tokens only, never "fastest".
VARIANTS = ("one_kernel_wd", "one_kernel_tk")


def fastest_ranges(rows, paths):
    """{path: [(T_first, T_last), ...]}: runs of consecutive measured T where the
    path is the fastest of ``paths``."""
    runs = {p: [] for p in paths}  # [first T, last T, index of the last row]
    for i, r in enumerate(rows):
        timed = {p: r[p] for p in paths if r.get(p) is not None}
        if not timed:
            continue
        best = runs[min(timed, key=timed.get)]
        if best and best[-1][2] == i - 1:
            best[-1][1:] = [r["T"], i]
        else:
            best.append([r["T"], r["T"], i])
    return {p: [(a, b) for a, b, _ in spans] for p, spans in runs.items()}


def path_table(rows, world, hidden_size, dtype_name, device_name):
    """The measured choice between our two paths per T (what the entry point runs),
    built by the package (eagle_capture.parallel.paths), which also reads it."""
    return measured_table(
        world,
        [(r["T"], r.get("one_kernel"), r.get("nccl_fused")) for r in rows],
        hidden_size,
        dtype_name,
        device_name,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hidden-size", type=int, default=7168)
    p.add_argument("--tokens", type=int, nargs="+", default=[2**i for i in range(12)])
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--steps-per-graph", type=int, default=16)
    p.add_argument(
        "--watchdog-tokens",
        type=int,
        nargs="*",
        default=[1, 8, 64],
        help="T values at which the opt-in variants (+watchdog, +ticket) run",
    )
    p.add_argument("--out", default=None, help="folder for allreduce_capture_w{W}.json")
    p.add_argument("--write-table", default=None, help="write the measured path table here")
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
    no_table = symm.PathTable({})  # ignore $EAGLE_CAPTURE_ALLREDUCE_TABLE: one-shot at every T
    ar = symm.SymmAllReduceCapture(
        T_max, H, dtype, device=device, one_shot_max_tokens=T_max, table=no_table
    )
    ar_wd = symm.SymmAllReduceCapture(
        max(args.watchdog_tokens + [1]),
        H,
        dtype,
        device=device,
        one_shot_max_tokens=T_max,
        table=no_table,
        watchdog_s=10,
    )
    ar_tk = symm.SymmAllReduceCapture(
        max(args.watchdog_tokens + [1]),
        H,
        dtype,
        device=device,
        one_shot_max_tokens=T_max,
        table=no_table,
        rows_by_ticket=True,
    )
    torch_buf = symm_mem.empty(T_max, H, dtype=dtype, device=device)
    symm_mem.rendezvous(torch_buf, dist.group.WORLD)
    group_name = dist.group.WORLD.group_name
    g = torch.Generator(device="cpu").manual_seed(0)
    weight = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype).to(device)
    aux = torch.empty(T_max, 3, H, dtype=dtype, device=device)
    rows = []
    for T in args.tokens:
        partial = torch.randn(T, H, generator=g).to(dtype).to(device)
        residual = torch.randn(T, H, generator=g).to(dtype).to(device)

        def one_kernel():
            ar.reduce_add_rmsnorm(partial, residual, weight, eps, aux, 1, norm_fp32_sum=True)

        def one_kernel_wd():
            ar_wd.reduce_add_rmsnorm(partial, residual, weight, eps, aux, 1, norm_fp32_sum=True)

        def one_kernel_tk():
            ar_tk.reduce_add_rmsnorm(partial, residual, weight, eps, aux, 1, norm_fp32_sum=True)

        def nccl_fused():
            dist.all_reduce(partial)
            ec.add_rmsnorm_capture(partial, residual, weight, eps, aux, 1, norm_fp32_sum=True)

        def symm1_fused():
            torch_buf[:T].copy_(partial)
            reduced = torch.ops.symm_mem.one_shot_all_reduce(torch_buf[:T], "sum", group_name)
            ec.add_rmsnorm_capture(reduced, residual, weight, eps, aux, 1, norm_fp32_sum=True)

        def symm2_fused():
            torch_buf[:T].copy_(partial)
            torch.ops.symm_mem.two_shot_all_reduce_(torch_buf[:T], "sum", group_name)
            ec.add_rmsnorm_capture(torch_buf[:T], residual, weight, eps, aux, 1, norm_fp32_sum=True)

        fns = {
            "one_kernel": one_kernel,
            "one_kernel_wd": one_kernel_wd,
            "one_kernel_tk": one_kernel_tk,
            "nccl_fused": nccl_fused,
            "symm1_fused": symm1_fused,
            "symm2_fused": symm2_fused,
        }
        row = {"T": T}
        for name, fn in fns.items():
            if name in VARIANTS and (T not in args.watchdog_tokens or T > ar_wd.max_tokens):
                row[name] = None
                continue
            dist.barrier()
            try:
                row[name] = time_graph_replay([fn], args.steps_per_graph, args.replays)
            except Exception as exc:  # report the path that cannot run here, keep going
                row[name] = None
                row[name + "_error"] = f"{type(exc).__name__}: {exc}"[:200]
            torch.cuda.synchronize()
        rows.append(row)
    # Host time of one eager call at T = 1 (the GPU work is ~us; the host dominates).
    partial1 = torch.randn(1, H, device=device, dtype=dtype)
    residual1 = torch.randn(1, H, device=device, dtype=dtype)
    dist.barrier()
    host = {
        "one_kernel": host_us_per_call(
            lambda: ar.reduce_add_rmsnorm(
                partial1, residual1, weight, eps, aux, 1, norm_fp32_sum=True
            ),
            2000,
            warmup=200,
        ),
        "add_rmsnorm_capture (1 GPU)": host_us_per_call(
            lambda: ec.add_rmsnorm_capture(
                partial1, residual1, weight, eps, aux, 1, norm_fp32_sum=True
            ),
            2000,
            warmup=200,
        ),
    }
    if rank == 0:
        report(rows, world, H, host)
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"allreduce_capture_w{world}.json"), "w") as f:
                json.dump(
                    {
                        "world_size": world,
                        "hidden_size": H,
                        "rows": rows,
                        "fastest": fastest_ranges(rows, [q for q in PATHS if q not in VARIANTS]),
                        "host_us": host,
                        "device": torch.cuda.get_device_name(),
                        "torch": torch.__version__,
                        "steps_per_graph": args.steps_per_graph,
                        "replays": args.replays,
                        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                        "command": " ".join(sys.argv),
                    },
                    f,
                    indent=1,
                )
        if args.write_table:
            write_table(
                path_table(rows, world, H, "bfloat16", torch.cuda.get_device_name()),
                args.write_table,
            )
            print(f"path table written to {args.write_table}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def report(rows, world, H, host) -> None:
    print(
        f"world size {world}, H = {H}, bf16; us per layer boundary "
        f"(graph replay median); the fastest of each row is marked *"
    )
    print(f"{'T':>6} " + " ".join(f"{LABELS[k]:>12}" for k in PATHS) + f" {'nccl/one':>9}")
    compared = [k for k in PATHS if k not in VARIANTS]
    for r in rows:
        timed = {k: r[k] for k in compared if r.get(k) is not None}
        best = min(timed, key=timed.get) if timed else None
        cells = []
        for k in PATHS:
            v = r.get(k)
            cells.append(f"{'-' if v is None else f'{v:.1f}' + ('*' if k == best else ' '):>12}")
        ratio = (
            r["nccl_fused"] / r["one_kernel"]
            if r.get("nccl_fused") and r.get("one_kernel")
            else None
        )
        print(
            f"{r['T']:>6} " + " ".join(cells) + f" {'-' if ratio is None else f'{ratio:.2f}x':>9}"
        )
    for r in rows:
        for k in PATHS:
            if r.get(k + "_error"):
                print(f"  T={r['T']} {LABELS[k]}: {r[k + '_error']}")
    print("fastest path by T:")
    for k, runs in fastest_ranges(rows, compared).items():
        spans = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs) or "never"
        print(f"  {LABELS[k]:>12}: {spans}")
    print("host us per eager call at T = 1: " + ", ".join(f"{k} {v:.1f}" for k, v in host.items()))


if __name__ == "__main__":
    sys.exit(main())
