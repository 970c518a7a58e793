"""Where the host time of one eager capture call goes (GPU machine, T = 1).

Times each layer of the eager call stack separately -- Triton's own
``kernel[grid]``, the cached launcher, the raw compiled launcher, the
public op -- and prints a cProfile of the public call. Used to drive the
host-overhead work; results in benchmarks/NOTES.md.
"""

import cProfile
import pstats

import torch

import eagle_capture as ec
from eagle_capture import ops
from eagle_capture.bench import host_us_per_call
from eagle_capture.kernels import add_rmsnorm_capture_kernel


def main():
    H = 7168
    h = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(h)
    aux = torch.empty(8, 3, H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(h)
    ec.add_capture(h, r, aux, 0)
    grid, args, num_warps = ops._launch_args(h, r, None, 0.0, None, None, aux, 0)
    compiled = add_rmsnorm_capture_kernel[grid](*args, num_warps=num_warps)
    launcher = ops._cached_launch
    keys = launcher.cached_keys()
    print(f"direct launch supported: {launcher.direct}; cached kernels: {len(keys)}")
    try:
        from triton import knobs
        print(f"launch hooks: {knobs.runtime.launch_enter_hook} {knobs.runtime.launch_exit_hook}")
    except ImportError:
        pass
    stream = torch._C._cuda_getCurrentRawStream(0)
    key = keys[0] if keys else None
    int_args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    try:
        import inspect
        print("".join(inspect.getsource(type(compiled.run).__call__).splitlines(True)[:60]))
    except (TypeError, OSError) as exc:
        print(f"launcher source not available: {exc}")
    rows = {
        "torch.add(out=)": lambda: torch.add(h, r, out=out),
        "kernel[grid](...) (Triton's entry)": lambda: add_rmsnorm_capture_kernel[grid](
            *args, num_warps=num_warps),
        "compiled.run(...) (raw launcher)": lambda: compiled.run(
            grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata,
            None, None, None, *args),
        "compiled.run(...) int pointers": lambda: compiled.run(
            grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata,
            None, None, None, *int_args),
        "6x tensor.data_ptr()": lambda: [t.data_ptr() for t in args[:6]],
        "key of 3 tensors (shape, stride, dtype, device)": lambda: tuple(
            (t.shape, t.stride(), t.dtype, t.device) for t in (h, r, aux)),
        "key of 3 tensors (shape, stride, dtype, get_device)": lambda: tuple(
            (t.shape, t.stride(), t.dtype, t.get_device()) for t in (h, r, aux)),
        "CachedLauncher call": lambda: launcher(grid, args, key, num_warps, 0, True),
        "ec.add_capture (public)": lambda: ec.add_capture(h, r, aux, 0),
        "torch.cuda.current_device()": torch.cuda.current_device,
    }
    for name, fn in rows.items():
        # The best of 5 chunks (capture_latency.py reports their median).
        us = host_us_per_call(fn, 3000, warmup=100, summary=min)
        print(f"  {name:<40} {us:6.2f} us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3000):
        ec.add_capture(h, r, aux, 0)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()
