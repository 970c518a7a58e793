"""Launch-parameter sweep for the fused kernel on the GPU (H = 7168 bf16).

* add+RMSNorm (+ slot store): one program per row, num_warps in {4, 8, 16, 32};
* capture only (no norm): column blocks of 1024 .. 8192 elements x num_warps.

CUDA-graph replay of 20 launches, input sets rotated so that nothing is
served from L2; us per launch and % of a copy roofline measured in the same
run. Used to choose ``kernels.add_rmsnorm_capture.launch_config``; the
results are recorded in benchmarks/NOTES.md.
"""

import argparse
import torch
import triton

from eagle_capture.bench import time_graph_replay
from eagle_capture.kernels import add_rmsnorm_capture_kernel, launch_config


def graph_time_us(fns, replays=20):
    """Median us per call of a graph that calls each fn in ``fns`` once."""
    return time_graph_replay(fns, len(fns), replays)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden-size", type=int, default=7168)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 4096, 16384])
    args = p.parse_args()
    H = args.hidden_size
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    roof = 4 * (1 << 30) / graph_time_us([lambda: dst.copy_(src)] * 4) / 1e3
    del src, dst
    print(f"copy roofline {roof:.0f} GB/s; launch_config({H}) = {launch_config(H, True)} "
          f"(norm), {launch_config(H, False)} (capture only)")
    variants = [("norm", nw, triton.next_power_of_2(H)) for nw in (4, 8, 16, 32)]
    variants += [("norm+cap", nw, triton.next_power_of_2(H)) for nw in (4, 8, 16, 32)]
    variants += [("cap", nw, blk) for blk in (1024, 2048, 4096, 8192) for nw in (2, 4, 8, 16)
                 if blk // (nw * 32) >= 8 or blk >= 8192]
    print(f"{'T':>6} " + " ".join(f"{v[0]}/w{v[1]}/b{v[2]}".rjust(18) for v in variants))
    for T in args.tokens:
        # Rotate input sets so the graph never reads what it just wrote (cold L2).
        sets = max(1, min(20, (400 << 20) // (T * H * 2 * 3)))
        data = [(torch.randn(T, H, device="cuda", dtype=torch.bfloat16),
                 torch.randn(T, H, device="cuda", dtype=torch.bfloat16)) for _ in range(sets)]
        w = torch.ones(H, device="cuda", dtype=torch.bfloat16)
        aux = torch.empty(T, 3, H, device="cuda", dtype=torch.bfloat16)
        cells = []
        for kind, nw, blk in variants:
            norm = kind != "cap"
            capture = kind != "norm"
            grid = (T, 1) if norm else (T, triton.cdiv(H, blk))

            def launch(h, r):
                add_rmsnorm_capture_kernel[grid](
                    h, r, w, h, r, aux, H, 1e-6, h.stride(0), r.stride(0), h.stride(0),
                    r.stride(0), aux.stride(0), aux.stride(1),
                    HAS_RESIDUAL=True, APPLY_NORM=norm, STORE_RESIDUAL=norm,
                    CAPTURE=capture, BLOCK_H=blk, USE_PDL=False, num_warps=nw)
            us = graph_time_us([lambda h=h, r=r: launch(h, r) for h, r in data])
            nbytes = {"norm": 4, "norm+cap": 5, "cap": 3}[kind] * T * H * 2
            cells.append(f"{us:8.2f} {100 * nbytes / us / 1e3 / roof:4.0f}%   ")
        print(f"{T:>6} " + " ".join(c.rjust(18) for c in cells))
        del data, aux
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
