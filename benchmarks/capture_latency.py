"""EAGLE-3 aux-hidden-state capture: fused ops vs the eager ``torch.cat`` path.

Answers one question for a serving engineer: what does capturing K layers'
hidden states cost per forward step, with SGLang's paths and with ours, and
how close is each to the GPU's memory-bandwidth roofline?

Paths (all K captured layers of one forward step, bf16 by default):

  a  eager        SGLang <= 0.5.13: ``h + r`` per layer, ``torch.cat(aux, -1)``
  b  packer       SGLang >= 0.5.18: the layer's add+RMSNorm, then ``copy_`` of the
                  residual into the packed buffer's column slice
  c  add_capture  fused add + store into the slot (no norm)
  d  norm         fused add+RMSNorm, no capture: the work the layer does anyway
  e  norm+store   add+RMSNorm that also stores the residual into the slot
  f  norm->slot   add+RMSNorm whose residual output *is* the slot (no extra write)
  g  compile      torch.compile of an eager add+RMSNorm (the kernel to beat for d)
  h  liger        Liger-Kernel's fused add+RMSNorm, when liger-kernel is installed

For b, e and f the figure that matters is the capture's own cost: the time
over d. Bytes are counted explicitly per path (every input read once, every
output written once) and reported as GB/s and as % of a device-to-device copy
roofline measured in the same run.

GPU time is measured two ways after warm-up: CUDA-graph replay (several steps
per graph, median over replays: no launch gaps, what decode under CUDA graphs
sees) and CUDA events around eager steps (median: what eager prefill sees,
launch overhead included once the GPU runs ahead of the host). Host time per
op call is measured separately in eager mode.

Without a GPU the script runs the CPU path (the ops' torch implementation) on
small sizes and says so: GPU figures need a GPU.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

import eagle_capture as ec

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_TOKENS = [2**i for i in range(15)]  # 1 .. 16384
EPS = 1e-6

PATHS = {
    "a": "eager h+r, torch.cat",
    "b": "norm + copy_ to slice",
    "c": "fused add_capture",
    "d": "add+RMSNorm (no capture)",
    "e": "add+RMSNorm + slot store",
    "f": "add+RMSNorm -> slot",
    "g": "torch.compile add+RMSNorm",
    "h": "Liger fused add+RMSNorm",
    "i": "e, norm of fp32 sum (SGLang drop-in)",
}


def liger_fused_add_rmsnorm():
    """Liger-Kernel's fused add+RMSNorm (out of place), or None if not installed."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    except ImportError:
        return None
    return LigerFusedAddRMSNormFunction


def bytes_moved(path: str, num_tokens: int, hidden_size: int, num_captures: int,
                elem: int) -> int:
    """Fewest bytes each path must move for all K layers (reads + writes)."""
    row = num_tokens * hidden_size * elem          # one [T, H] tensor
    weight = hidden_size * elem
    per_layer = {
        "a": 3 * row + 2 * row,                    # add: r h, r r, w s;  cat: r s, w out
        "b": 4 * row + weight + 2 * row,           # norm (r h, r r, w h, w r) + copy (r, w)
        "c": 3 * row,                              # r h, r r, w slot
        "d": 4 * row + weight,                     # r h, r r, w h, w r
        "e": 5 * row + weight,                     # d + w slot
        "i": 5 * row + weight,                     # e, FlashInfer's norm input
        "f": 4 * row + weight,                     # r h, r r, w h, w slot
        "g": 4 * row + weight,
        "h": 4 * row + weight + num_tokens * 4,   # + its fp32 rstd per row
    }[path]
    return num_captures * per_layer


# ----------------------------------------------------------------------------
# The paths, as closures over per-layer inputs
# ----------------------------------------------------------------------------

@dataclass
class Inputs:
    hidden: list          # K x [T, H]
    residual: list        # K x [T, H]
    weight: list          # K x [H]
    aux: torch.Tensor     # [max_tokens, K, H]
    num_tokens: int
    extra: dict = field(default_factory=dict)


def make_inputs(num_tokens: int, hidden_size: int, num_captures: int, dtype, device) -> Inputs:
    g = torch.Generator(device="cpu").manual_seed(num_tokens)

    def rows():
        return torch.randn(num_tokens, hidden_size, generator=g).to(dtype=dtype, device=device)

    return Inputs(
        hidden=[rows() for _ in range(num_captures)],
        residual=[rows() for _ in range(num_captures)],
        weight=[(1 + 0.1 * torch.randn(hidden_size, generator=g)).to(dtype=dtype, device=device)
                for _ in range(num_captures)],
        aux=torch.empty(num_tokens, num_captures, hidden_size, dtype=dtype, device=device),
        num_tokens=num_tokens,
    )


def _eager_add_rmsnorm(h: torch.Tensor, r: torch.Tensor, w: torch.Tensor):
    """Out of place (fresh outputs): Inductor's best case -- the in-place form
    made it copy back into the inputs, slower at every T on the H200."""
    s = h + r
    x = s.float()
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(h.dtype), s


_compiled_add_rmsnorm = None


def compiled_add_rmsnorm():
    global _compiled_add_rmsnorm
    if _compiled_add_rmsnorm is None:
        # One static-shape graph per T (Inductor's best case); lift the default
        # recompile limit (8) so every T of the sweep really runs compiled.
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
        _compiled_add_rmsnorm = torch.compile(_eager_add_rmsnorm, fullgraph=True, dynamic=False)
    return _compiled_add_rmsnorm


def build_step(path: str, x: Inputs) -> Callable[[], object]:
    k_range = range(len(x.hidden))
    h, r, w, aux, t = x.hidden, x.residual, x.weight, x.aux, x.num_tokens
    if path == "a":
        def step():
            captured = [h[k] + r[k] for k in k_range]
            return torch.cat(captured, dim=-1)
    elif path == "b":
        flat = aux.view(aux.shape[0], -1)
        hidden_size = h[0].shape[1]

        def step():
            for k in k_range:
                ec.add_rmsnorm_capture(h[k], r[k], w[k], EPS)
                flat[:t, k * hidden_size:(k + 1) * hidden_size].copy_(r[k])
    elif path == "c":
        def step():
            for k in k_range:
                ec.add_capture(h[k], r[k], aux, k)
    elif path == "d":
        def step():
            for k in k_range:
                ec.add_rmsnorm_capture(h[k], r[k], w[k], EPS)
    elif path == "e":
        def step():
            for k in k_range:
                ec.add_rmsnorm_capture(h[k], r[k], w[k], EPS, aux, k)
    elif path == "i":
        def step():
            for k in k_range:
                ec.add_rmsnorm_capture(h[k], r[k], w[k], EPS, aux, k, norm_fp32_sum=True)
    elif path == "f":
        def step():
            for k in k_range:
                ec.add_rmsnorm_into_slot(h[k], r[k], w[k], EPS, aux, k)
    elif path == "g":
        fn = compiled_add_rmsnorm()

        def step():
            return [fn(h[k], r[k], w[k]) for k in k_range]
    elif path == "h":
        liger = liger_fused_add_rmsnorm()

        def step():
            with torch.no_grad():
                return [liger.apply(h[k], r[k], w[k], EPS) for k in k_range]
    else:
        raise ValueError(path)
    return step


def check_path(path: str, x: Inputs) -> None:
    """Run one step on fresh copies and compare with the eager reference: the
    captured values bit-exact, normed outputs to bf16 rounding."""
    y = Inputs([t.clone() for t in x.hidden], [t.clone() for t in x.residual], x.weight,
               torch.full_like(x.aux, float("nan")), x.num_tokens)
    out = build_step(path, y)()
    expected = [h + r for h, r in zip(x.hidden, x.residual)]
    if path in ("g", "h"):  # out of place: (normed, residual) per layer
        y.hidden = [normed for normed, _ in out]
        got = torch.cat([res for _, res in out], -1)
    elif path == "a":
        got = out
    elif path == "d":
        got = torch.cat(y.residual, -1)
    else:
        got = y.aux[:x.num_tokens].flatten(1)
    if not torch.equal(got, torch.cat(expected, -1)):
        raise AssertionError(f"path {path}: captured values differ from eager h + r")
    if path in ("b", "d", "e", "f", "g", "h", "i"):
        for k, s in enumerate(expected):
            ref = ec.add_rmsnorm_reference(s, torch.zeros_like(s), x.weight[k], EPS)[0]
            rel = ((y.hidden[k].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if rel > 1e-2:
                raise AssertionError(f"path {path}: normed output rel err {rel:.2e}")


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------

def time_graph_replay(steps: list, steps_per_graph: int, replays: int) -> float:
    """Median GPU microseconds per step from CUDA-graph replays; the graph walks
    the rotated input sets in ``steps`` round-robin."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for step in steps:
            step()
    torch.cuda.current_stream().wait_stream(side)
    steps_per_graph = max(steps_per_graph, len(steps))
    graph = torch.cuda.CUDAGraph()
    # Out-of-place paths (a, g, h) return fresh outputs. Kept alive, each step
    # of the graph writes to its own memory; dropped, the graph pool would hand
    # every step the same block, whose dirty lines can be rewritten in L2
    # without ever reaching DRAM -- a write discount no layer of a model gets
    # (benchmarks/NOTES.md, "Output reuse in graph replay").
    outputs = []
    with torch.cuda.graph(graph):
        for i in range(steps_per_graph):
            outputs.append(steps[i % len(steps)]())
    for _ in range(3):
        graph.replay()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for i in range(replays):
        start[i].record()
        graph.replay()
        end[i].record()
    torch.cuda.synchronize()
    del graph, outputs
    times = [s.elapsed_time(e) * 1e3 / steps_per_graph for s, e in zip(start, end)]
    return statistics.median(times)


def time_events(steps: list, reps: int) -> float:
    """Median microseconds per eager step, CUDA events around each step."""
    for step in steps:
        step()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        start[i].record()
        steps[i % len(steps)]()
        end[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(start, end))


def measure_copy_roofline(device, nbytes: int = 2 << 30, reps: int = 20) -> dict:
    """Device-to-device copy bandwidth, bytes read + written, in this run."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    us = time_events([lambda: dst.copy_(src)], reps)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": 2 * nbytes, "us": us, "gbps": 2 * nbytes / us / 1e3}


def measure_host_overhead(hidden_size: int, dtype, device, calls: int = 2000) -> dict:
    """Host microseconds per call in eager mode, T = 1 (the GPU never limits)."""
    x = make_inputs(1, hidden_size, 1, dtype, device)
    h, r, w, aux = x.hidden[0], x.residual[0], x.weight[0], x.aux
    out = torch.empty_like(h)
    ops = torch.ops.eagle_capture
    candidates = {
        "torch.add(out=)": lambda: torch.add(h, r, out=out),
        "add_capture (public, eager fast path)": lambda: ec.add_capture(h, r, aux, 0),
        "add_capture (torch.ops, dispatcher)": lambda: ops.add_capture(h, r, aux, 0),
        "add_rmsnorm_capture (public)": lambda: ec.add_rmsnorm_capture(h, r, w, EPS, aux, 0),
        "add_rmsnorm_capture (torch.ops)": lambda: ops.add_rmsnorm_capture(h, r, w, EPS, aux, 0),
    }
    result = {}
    for name, fn in candidates.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize() if device.type == "cuda" else None
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(calls // 5):
                fn()
            samples.append((time.perf_counter() - t0) * 1e6 / (calls // 5))
            if device.type == "cuda":
                torch.cuda.synchronize()
        result[name] = statistics.median(samples)
    return result


def device_identity() -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if not torch.cuda.is_available():
        info["device"] = f"CPU ({platform.processor() or platform.machine()}, "\
                         f"{os.cpu_count()} cores)"
        return info
    props = torch.cuda.get_device_properties(0)
    info.update(device=props.name, sm_count=props.multi_processor_count,
                memory_gib=round(props.total_memory / 2**30, 1))
    try:
        import pynvml as nvml
        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        info.update(
            nvml_name=nvml.nvmlDeviceGetName(handle),
            driver=nvml.nvmlSystemGetDriverVersion(),
            sm_clock_mhz=nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM),
            mem_clock_mhz=nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_MEM),
            max_sm_clock_mhz=nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM),
            power_limit_w=nvml.nvmlDeviceGetPowerManagementLimit(handle) / 1000,
            temperature_c=nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
        )
        nvml.nvmlShutdown()
    except Exception as exc:  # nvidia-ml-py missing or NVML unavailable: say so
        info["nvml_error"] = repr(exc)
    return info


# ----------------------------------------------------------------------------
# Sweep, report
# ----------------------------------------------------------------------------

def progress(iterable, total, desc):
    try:
        from tqdm import tqdm
        return tqdm(iterable, total=total, desc=desc, file=sys.stderr, leave=False)
    except ImportError:
        return iterable


def run_gpu(args) -> dict:
    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    roofline = measure_copy_roofline(device)
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    rows = []
    for num_tokens in progress(args.tokens, len(args.tokens), "T sweep"):
        # Rotate input sets whose total is several times L2, so that no step
        # reads what the previous one left in cache (the model's layers read
        # fresh activations); all sets share one aux buffer, as SGLang does.
        per_set = 2 * args.num_captures * num_tokens * args.hidden_size * elem
        num_sets = max(1, min(16, -(-args.rotate_l2 * l2_bytes // per_set)))
        sets = [make_inputs(num_tokens, args.hidden_size, args.num_captures, dtype, device)
                for _ in range(num_sets)]
        for x in sets[1:]:
            x.aux = sets[0].aux
        x = sets[0]
        row = {"T": num_tokens, "input_sets": num_sets, "paths": {}}
        for path in args.paths:
            check_path(path, x)
            steps = [build_step(path, s) for s in sets]
            steps_per_graph = max(1, min(20, 4096 // num_tokens))
            graph_us = time_graph_replay(steps, steps_per_graph, args.replays)
            event_us = time_events(steps, args.reps)
            nbytes = bytes_moved(path, num_tokens, args.hidden_size, args.num_captures, elem)
            row["paths"][path] = {
                "graph_us": graph_us, "event_us": event_us, "bytes": nbytes,
                "graph_gbps": nbytes / graph_us / 1e3,
                "graph_pct_roofline": 100 * nbytes / graph_us / 1e3 / roofline["gbps"],
            }
        paths = row["paths"]
        floor_us = (num_tokens * args.hidden_size * elem * args.num_captures
                    / roofline["gbps"] / 1e3)
        row["extra_write_floor_us"] = floor_us
        if "d" in paths:
            row["capture_cost_us"] = {p: paths[p]["graph_us"] - paths["d"]["graph_us"]
                                      for p in ("b", "e", "f") if p in paths}
        rows.append(row)
        del x, sets, steps
        torch.cuda.empty_cache()
    host = measure_host_overhead(args.hidden_size, dtype, device)
    return {"roofline": roofline, "rows": rows, "host_us_per_call": host}


def run_cpu(args) -> dict:
    """The ops' CPU path (torch) at small sizes; wall-clock medians."""
    device = torch.device("cpu")
    dtype = DTYPES[args.dtype]
    rows = []
    for num_tokens in progress(args.tokens, len(args.tokens), "T sweep (CPU)"):
        x = make_inputs(num_tokens, args.hidden_size, args.num_captures, dtype, device)
        row = {"T": num_tokens, "paths": {}}
        for path in [p for p in args.paths if p not in ("g", "h")]:
            check_path(path, x)
            step = build_step(path, x)
            for _ in range(3):
                step()
            samples = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                step()
                samples.append((time.perf_counter() - t0) * 1e6)
            row["paths"][path] = {"wall_us": statistics.median(samples)}
        rows.append(row)
    return {"rows": rows}


def print_gpu_table(result: dict, args) -> None:
    roof = result["roofline"]
    print(f"\ncopy roofline (this run): {roof['gbps']:.0f} GB/s "
          f"(device-to-device, {roof['bytes'] / 2**30:.0f} GiB read + written)")
    print(f"H = {args.hidden_size}, K = {args.num_captures} captured layers, {args.dtype}. "
          f"GPU us per forward step (all K layers), CUDA-graph replay, median;")
    print("[% of copy roofline]; capture cost = time over path d; floor = one extra write.\n")
    paths = args.paths
    header = f"{'T':>6} | " + " | ".join(f"{p}: {PATHS[p][:18]:<18}" for p in paths)
    header += " | cost b / e / f (floor) us"
    print(header)
    print("-" * len(header))
    for row in result["rows"]:
        cells = []
        for p in paths:
            d = row["paths"][p]
            cells.append(f"{d['graph_us']:8.1f} [{d['graph_pct_roofline']:3.0f}%]     ")
        cost = row.get("capture_cost_us", {})
        cost_s = " / ".join(f"{cost[p]:+6.1f}" if p in cost else "   -  " for p in "bef")
        print(f"{row['T']:>6} | " + " | ".join(f"{c:<21}" for c in cells)
              + f" | {cost_s} ({row['extra_write_floor_us']:.1f})")
    print("\nEager (CUDA events, launch overhead included), us per step:")
    print(f"{'T':>6} | " + " | ".join(f"{p:>8}" for p in paths))
    for row in result["rows"]:
        print(f"{row['T']:>6} | " + " | ".join(f"{row['paths'][p]['event_us']:8.1f}"
                                               for p in paths))
    print("\nHost time per op call, eager, T = 1 (us):")
    for name, us in result["host_us_per_call"].items():
        print(f"  {name:<42} {us:6.1f}")


def print_cpu_table(result: dict, args) -> None:
    paths = [p for p in args.paths if p not in ("g", "h")]
    print(f"\nCPU path (torch implementation), H = {args.hidden_size}, K = "
          f"{args.num_captures}, {args.dtype}: wall-clock us per step, median")
    print(f"{'T':>6} | " + " | ".join(f"{p}: {PATHS[p][:18]:<18}" for p in paths))
    for row in result["rows"]:
        print(f"{row['T']:>6} | " + " | ".join(f"{row['paths'][p]['wall_us']:<21.1f}"
                                               for p in paths))


def plot(result: dict, args, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = result["rows"]
    tokens = [r["T"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for p in args.paths:
        ax1.plot(tokens, [r["paths"][p]["graph_us"] for r in rows], marker="o", ms=3,
                 label=f"{p}: {PATHS[p]}")
    ax1.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="GPU us per step (graph replay)",
            title=f"Capture of K={args.num_captures} layers, H={args.hidden_size}, {args.dtype}")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    for p in ("b", "e", "f"):
        if all(p in r.get("capture_cost_us", {}) for r in rows):
            ax2.plot(tokens, [max(r["capture_cost_us"][p], 0.05) for r in rows], marker="o",
                     ms=3, label=f"{p}: {PATHS[p]}")
    ax2.plot(tokens, [r["extra_write_floor_us"] for r in rows], "k--", label="one extra write at roofline")
    ax2.set(xscale="log", yscale="log", xlabel="tokens T", ylabel="capture cost over d (us)",
            title="Capture overhead vs the layer's add+RMSNorm")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(f"  {k}  {v}" for k, v in PATHS.items()))
    p.add_argument("--hidden-size", type=int, default=7168,
                   help="H: 7168 DeepSeek-V3/Kimi-K2 (default), 4096 / 5120 Llama-class")
    p.add_argument("--num-captures", type=int, default=3, help="K captured layers (default 3)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--tokens", type=int, nargs="+", default=None,
                   help="T values (default 1 2 4 .. 16384 on a GPU, 1 .. 256 on CPU)")
    p.add_argument("--paths", default="abcdefghi",
                   help="which paths to run (default abcdefghi; h only where liger-kernel is installed)")
    p.add_argument("--reps", type=int, default=100, help="eager repetitions per point")
    p.add_argument("--replays", type=int, default=30, help="graph replays per point")
    p.add_argument("--rotate-l2", type=int, default=4,
                   help="rotate input sets totalling this many L2 sizes (default 4; 0: "
                        "one set, warm cache)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"),
                   help="folder for the JSON and PNG (default benchmarks/out)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    args = p.parse_args(argv)
    args.paths = [c for c in args.paths if c in PATHS]
    if "h" in args.paths and liger_fused_add_rmsnorm() is None:
        print("liger-kernel is not installed: path h (Liger fused add+RMSNorm) skipped")
        args.paths.remove("h")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    has_gpu = torch.cuda.is_available()
    info = device_identity()
    print(f"device: {info['device']}  torch {info['torch']}  triton {info['triton']}"
          + (f"  driver {info.get('driver')}" if has_gpu else ""))
    if has_gpu:
        args.tokens = args.tokens or DEFAULT_TOKENS
        result = run_gpu(args)
        print_gpu_table(result, args)
    else:
        print("No GPU: running the CPU path (torch implementation) on small sizes. "
              "GPU figures need a GPU.")
        args.tokens = args.tokens or [1, 4, 16, 64, 256]
        args.reps = min(args.reps, 20)
        result = run_cpu(args)
        print_cpu_table(result, args)
    result.update(config={k: v for k, v in vars(args).items()}, device=info,
                  date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), command=" ".join(sys.argv))
    stem = os.path.join(args.out, f"capture_latency_{'gpu' if has_gpu else 'cpu'}_H{args.hidden_size}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {stem}.json")
    if has_gpu and not args.no_plot:
        try:
            plot(result, args, stem + ".png")
            print(f"wrote {stem}.png")
        except ImportError:
            print("matplotlib not installed: no plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
