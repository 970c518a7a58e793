"""Launch-parameter sweep for the fused kernel (num_warps) on the GPU.

Times the add+RMSNorm (+ slot store) kernel for H = 7168 bf16 with every
num_warps in {4, 8, 16, 32} over a T sweep, CUDA-graph replay, and prints
us per launch and % of a copy roofline measured in the same run. Used to
choose ``kernels.add_rmsnorm_capture.launch_config``; see benchmarks/NOTES.md.
"""

import argparse
import statistics

import torch

from eagle_capture.kernels import add_rmsnorm_capture_kernel, launch_config


def graph_time_us(fn, inner=20, replays=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(inner):
            fn()
    g.replay()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(replays)]
    for a, b in ev:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) * 1e3 / inner for a, b in ev)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden-size", type=int, default=7168)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 4096, 16384])
    args = p.parse_args()
    H = args.hidden_size
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    roof_us = graph_time_us(lambda: dst.copy_(src), inner=2, replays=10)
    roof = 4 * (1 << 30) / roof_us / 1e3
    del src, dst
    print(f"copy roofline {roof:.0f} GB/s; default launch_config({H}) = {launch_config(H)}")
    block = launch_config(H)[0]
    print(f"{'T':>6} {'capture':>8} | " + " | ".join(f"w={w:<2}" + " " * 10 for w in (4, 8, 16, 32)))
    for T in args.tokens:
        h = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        r = torch.randn_like(h)
        w = torch.ones(H, device="cuda", dtype=torch.bfloat16)
        aux = torch.empty(T, 3, H, device="cuda", dtype=torch.bfloat16)
        for capture in (False, True):
            cells = []
            for nw in (4, 8, 16, 32):
                def launch():
                    add_rmsnorm_capture_kernel[(T,)](
                        h, r, w, h, r, aux, H, 1e-6, h.stride(0), r.stride(0), h.stride(0),
                        r.stride(0), aux.stride(0), aux.stride(1),
                        HAS_RESIDUAL=True, APPLY_NORM=True, STORE_RESIDUAL=True,
                        CAPTURE=capture, BLOCK_H=block, num_warps=nw)
                us = graph_time_us(launch)
                nbytes = (5 if capture else 4) * T * H * 2
                cells.append(f"{us:7.2f} {100 * nbytes / us / 1e3 / roof:3.0f}%  ")
            print(f"{T:>6} {str(capture):>8} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
