"""A few one-shot all-reduce + add + RMSNorm + capture calls at world size W,
checked against a float reference: the workload for compute-sanitizer.

    compute-sanitizer --tool memcheck --target-processes all \
        torchrun --nproc-per-node 2 tools/gpu/sanitize_allreduce.py

Prints "rank R: all N calls ok" per rank; exits 1 on a mismatch."""

import os
import sys

import torch
import torch.distributed as dist

from eagle_capture.parallel import symm
from eagle_capture.testing.reference import add_rmsnorm_reference


def main() -> int:
    symm.ensure_multicast_disabled()
    rank = int(os.environ.get("RANK", 0))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    calls = bad = 0
    for watchdog in (None, 5.0):
        ar = symm.SymmAllReduceCapture(
            160, 7168, torch.bfloat16, device=device, table=symm.PathTable({}), watchdog_s=watchdog
        )
        weight = torch.ones(7168, dtype=torch.bfloat16, device=device)
        for T in (1, 5, 133, 2, 133):
            g = torch.Generator().manual_seed(T)
            residual = torch.randn(T, 7168, generator=g).bfloat16().to(device)
            partials = [
                torch.randn(T, 7168, generator=g).bfloat16().to(device) for _ in range(world)
            ]
            h = torch.stack([p.float() for p in partials]).sum(0).bfloat16()
            _, res_ref = add_rmsnorm_reference(h, residual, weight, 1e-6)
            aux = torch.zeros(T, 3, 7168, dtype=torch.bfloat16, device=device)
            r = residual.clone()
            ar.reduce_add_rmsnorm(partials[rank].clone(), r, weight, 1e-6, aux, 2)
            torch.cuda.synchronize()
            calls += 1
            bad += not (torch.equal(r, res_ref) and torch.equal(aux[:, 2], res_ref))
    print(
        f"rank {rank}: {'all %d calls ok' % calls if not bad else '%d of %d calls WRONG' % (bad, calls)}"
    )
    dist.barrier()
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
