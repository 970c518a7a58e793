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
  j  flashinfer   SGLang >= 0.5.18 on CUDA as it runs: FlashInfer's fused_add_rmsnorm
                  (the kernel SGLang's RMSNorm calls), then the packer's ``copy_``
  k  flashinfer   FlashInfer's fused_add_rmsnorm alone: SGLang's norm without capture
                  (j and k where FlashInfer's norm loads: the strongest peer; the installed
                  package, else built from its kernel source, see flashinfer_norm.py)
  l  norm->slot   f normalising the unrounded fp32 sum: the SGLang drop-in's exact call
                  (``add_rmsnorm_into_slot(..., norm_fp32_sum=True)``), FlashInfer's math

For b, e and f the figure that matters is the capture's own cost: the time
over d, also given as a multiple of a measured write floor (one write of the
captured bytes, ``fill_`` in graph replay, less its launch's fixed cost: HBM
writes are slower than reads, so a copy's rate undercounts a write). Bytes are
counted explicitly per path (every input read once, every output written once)
and reported as % of a same-size copy roofline: one copy kernel (``src + 0``) of the
path's bytes, timed as the paths are. A 2 GiB eager copy is reported as well.

GPU time is measured two ways after warm-up: CUDA-graph replay (at least 8
steps per graph, every rotated buffer set once per graph, median over replays:
no launch gaps, what decode under CUDA graphs sees) and CUDA events around
eager steps (median: what eager prefill sees, launch overhead included once
the GPU runs ahead of the host). Each step reads, and writes into, its own
buffer set (aux buffer included); the sets total several L2 sizes at every T.
Host time per op call is measured separately in eager mode, T = 1; with
``--host-breakdown`` the script measures only that, layer by layer down the
eager call stack (Triton's entry point, its compiled launcher, the cached
launch), with a cProfile of the public call -- and runs no sweep.

PDL (programmatic dependent launch) is used by our kernel's eager launches
(paths b - f, i) on sm_90+ unless ``EAGLE_CAPTURE_PDL=0``; torch, Inductor and
Liger (a, g, h) cannot use it. ``--pdl on|off|both`` runs the script with it
on, off, or both in turn (child processes: ``eagle_capture`` fixes the
setting at its first launch) and compares the two.

Without a GPU the script runs the CPU path (the ops' torch implementation) on
small sizes and says so: GPU figures need a GPU. It prints min / median / max
per point and a warning, for CPU timings swing a lot between runs.

The printed tables fit 100 columns: a legend above each table keys the
columns (the path letters), and every requested path that is not run gets a
one-line reason.
"""

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

import eagle_capture as ec
from eagle_capture.ops import pdl_enabled
from eagle_capture.testing.bench import (
    add_graph_timing_arguments,
    graph_steps,
    host_us_per_call,
    measure_copy_graph,
    measure_copy_roofline,
    measure_write_floor,
    rotation_sets,
    time_events,
    time_graph_replay,
)
from eagle_capture.testing.reference import add_rmsnorm_reference

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the report, beside this file
import capture_report as report  # noqa: E402
from capture_report import (  # noqa: E402
    CPU_WARNING,
    FLASHINFER_MISSING,
    GPU_ONLY_PATHS,
    LIGER_MISSING,
    PATHS,
    legend_lines,
)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_TOKENS = [2**i for i in range(15)]  # 1 .. 16384
EPS = 1e-6


# Each rotated buffer set is one step of the CUDA graph: this bounds the graph
# (about 1460 sets at T = 1 for H = 7168, K = 3 and 4 x a 60 MiB L2).
MAX_SETS = 4096
# Memory kept free for allocations the plan does not count (temporaries of
# path a, Inductor's and Liger's workspaces, the graphs themselves).
MEMORY_MARGIN = 0.1
PDL_ENV = "EAGLE_CAPTURE_PDL"


def liger_fused_add_rmsnorm():
    """Liger-Kernel's fused add+RMSNorm (out of place), or None if not installed."""
    try:
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    except ImportError:
        return None
    return LigerFusedAddRMSNormFunction


_FLASHINFER = {}  # flashinfer_norm.load()'s answer, once per process


def flashinfer_fused_add_rmsnorm():
    """FlashInfer's in-place fused_add_rmsnorm (residual += x; x = norm(residual) * w),
    or None where it cannot be loaded (flashinfer_norm.load: the installed package,
    else FlashInfer's norm built from its kernel source in a carried bundle)."""
    return flashinfer_load()[0]


def flashinfer_load() -> tuple:
    """(fused_add_rmsnorm or None, which FlashInfer and how it was loaded, or why not)."""
    if not _FLASHINFER:
        import flashinfer_norm

        _FLASHINFER["fn"], _FLASHINFER["line"] = flashinfer_norm.load()
    return _FLASHINFER["fn"], _FLASHINFER["line"]


def bytes_moved(path: str, num_tokens: int, hidden_size: int, num_captures: int, elem: int) -> int:
    """Fewest bytes each path must move for all K layers (reads + writes)."""
    row = num_tokens * hidden_size * elem  # one [T, H] tensor
    weight = hidden_size * elem
    per_layer = {
        "a": 3 * row + 2 * row,  # add: r h, r r, w s;  cat: r s, w out
        "b": 4 * row + weight + 2 * row,  # norm (r h, r r, w h, w r) + copy (r, w)
        "c": 3 * row,  # r h, r r, w slot
        "d": 4 * row + weight,  # r h, r r, w h, w r
        "e": 5 * row + weight,  # d + w slot
        "i": 5 * row + weight,  # e, FlashInfer's norm input
        "f": 4 * row + weight,  # r h, r r, w h, w slot
        "l": 4 * row + weight,  # as f
        "g": 4 * row + weight,
        "h": 4 * row + weight + num_tokens * 4,  # + its fp32 rstd per row
        "j": 4 * row + weight + 2 * row,  # as b
        "k": 4 * row + weight,  # as d
    }[path]
    return num_captures * per_layer


def kept_bytes(path: str, num_tokens: int, hidden_size: int, num_captures: int, elem: int) -> int:
    """Bytes of the outputs one step of an out-of-place path returns, which the
    graph keeps alive for its whole length (bench.time_graph_replay); 0 for the
    in-place paths."""
    row = num_tokens * hidden_size * elem
    return num_captures * {"a": row, "g": 2 * row, "h": 2 * row + num_tokens * 4}.get(path, 0)


# ----------------------------------------------------------------------------
# The paths, as closures over per-layer inputs
# ----------------------------------------------------------------------------


@dataclass
class Inputs:
    hidden: list  # K x [T, H]
    residual: list  # K x [T, H]
    weight: list  # K x [H]
    aux: torch.Tensor  # [max_tokens, K, H]
    num_tokens: int
    extra: dict = field(default_factory=dict)


def make_inputs(num_tokens: int, hidden_size: int, num_captures: int, dtype, device) -> Inputs:
    g = torch.Generator(device="cpu").manual_seed(num_tokens)

    def rows():
        return torch.randn(num_tokens, hidden_size, generator=g).to(dtype=dtype, device=device)

    return Inputs(
        hidden=[rows() for _ in range(num_captures)],
        residual=[rows() for _ in range(num_captures)],
        weight=[
            (1 + 0.1 * torch.randn(hidden_size, generator=g)).to(dtype=dtype, device=device)
            for _ in range(num_captures)
        ],
        aux=torch.empty(num_tokens, num_captures, hidden_size, dtype=dtype, device=device),
        num_tokens=num_tokens,
    )


def _eager_add_rmsnorm(h: torch.Tensor, r: torch.Tensor, w: torch.Tensor):
    """Out of place (fresh outputs): Inductor's best case -- the in-place form
    made it copy back into the inputs, slower at every T on the H200."""
    # Spelled out, not eagle_capture.testing.reference.rmsnorm_fp32: these plain torch ops are path g.
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
                flat[:t, k * hidden_size : (k + 1) * hidden_size].copy_(r[k])
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
    elif path in ("f", "l"):
        fp32_sum = path == "l"

        def step():
            for k in k_range:
                ec.add_rmsnorm_into_slot(h[k], r[k], w[k], EPS, aux, k, norm_fp32_sum=fp32_sum)
    elif path == "g":
        fn = compiled_add_rmsnorm()

        def step():
            return [fn(h[k], r[k], w[k]) for k in k_range]
    elif path in ("j", "k"):
        fused_add_rmsnorm = flashinfer_fused_add_rmsnorm()
        flat = aux.view(aux.shape[0], -1)
        hidden_size = h[0].shape[1]
        copy = path == "j"

        def step():
            for k in k_range:
                fused_add_rmsnorm(h[k], r[k], w[k], EPS)
                if copy:
                    flat[:t, k * hidden_size : (k + 1) * hidden_size].copy_(r[k])
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
    y = Inputs(
        [t.clone() for t in x.hidden],
        [t.clone() for t in x.residual],
        x.weight,
        torch.full_like(x.aux, float("nan")),
        x.num_tokens,
    )
    out = build_step(path, y)()
    expected = [h + r for h, r in zip(x.hidden, x.residual)]
    if path in ("g", "h"):  # out of place: (normed, residual) per layer
        y.hidden = [normed for normed, _ in out]
        got = torch.cat([res for _, res in out], -1)
    elif path == "a":
        got = out
    elif path in ("d", "k"):
        got = torch.cat(y.residual, -1)
    else:
        got = y.aux[: x.num_tokens].flatten(1)
    if not torch.equal(got, torch.cat(expected, -1)):
        raise AssertionError(f"path {path}: captured values differ from eager h + r")
    if path in ("b", "d", "e", "f", "g", "h", "i", "j", "k", "l"):
        for k, s in enumerate(expected):
            ref = add_rmsnorm_reference(s, torch.zeros_like(s), x.weight[k], EPS)[0]
            rel = ((y.hidden[k].double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
            if rel > 1e-2:
                raise AssertionError(f"path {path}: normed output rel err {rel:.2e}")


# ----------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------


def host_calls(hidden_size: int, dtype, device, breakdown: bool = False) -> tuple:
    """({name: zero-argument call}, {fact: value}) for the host-time table, T = 1
    (the GPU never limits): torch.add and the public ops, eager fast path and
    dispatcher. ``breakdown`` (CUDA only) adds the layers under the public
    ``add_capture`` and facts about its launch path (:func:`launch_layers`)."""
    x = make_inputs(1, hidden_size, 1, dtype, device)
    h, r, w, aux = x.hidden[0], x.residual[0], x.weight[0], x.aux
    out = torch.empty_like(h)
    ops = torch.ops.eagle_capture
    calls = {
        "torch.add(out=)": lambda: torch.add(h, r, out=out),
        "add_capture (public, eager fast path)": lambda: ec.add_capture(h, r, aux, 0),
        "add_capture (torch.ops, dispatcher)": lambda: ops.add_capture(h, r, aux, 0),
        "add_rmsnorm_capture (public)": lambda: ec.add_rmsnorm_capture(h, r, w, EPS, aux, 0),
        "add_rmsnorm_capture (torch.ops)": lambda: ops.add_rmsnorm_capture(h, r, w, EPS, aux, 0),
    }
    if not breakdown:
        return calls, {}
    layers, facts = launch_layers(h, r, aux)
    return {**calls, **layers}, facts


def eager_plan(h: torch.Tensor, r: torch.Tensor, aux: torch.Tensor):
    """(the call's five tensors, the Plan the eager path makes for
    ``ec.add_capture(h, r, aux, 0)``): its grid, arguments and PDL setting.
    CPU tensors get the kernel's plan under Triton's interpreter."""
    import eagle_capture as ec
    from eagle_capture.ops import table
    from eagle_capture.testing.kernel import kernel_on_cpu

    tensors = (h, r, None, aux, None)
    with kernel_on_cpu() if h.device.type == "cpu" else contextlib.nullcontext():
        return tensors, table._plan(ec.add_capture.capture_op, tensors, 0.0, 0, False)


def launch_layers(h: torch.Tensor, r: torch.Tensor, aux: torch.Tensor) -> tuple:
    """The layers under ``ec.add_capture(h, r, aux, 0)`` on a CUDA device, each
    callable alone, all launching the op's kernel with the op's arguments:
    Triton's entry point, the compiled kernel's launcher (tensor and integer
    pointers), the eager fast path's launch (``ops.FastLaunch``) and the
    DirectLaunch its plan keeps, pieces of the memo key; and facts about that
    launch path. ({name: call}, {fact: value})"""
    from eagle_capture import ops
    from eagle_capture.kernels import add_rmsnorm_capture_kernel as kernel

    tensors, plan = eager_plan(h, r, aux)
    args = (*plan.head(tensors), *plan.tail_entry)
    int_args = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
    options = {"num_warps": plan.num_warps, **({"launch_pdl": True} if plan.use_pdl else {})}
    grid = plan.grid
    gx, gy = grid
    stream = torch._C._cuda_getCurrentRawStream(h.device.index)
    # A fast path of our own (not the op's): the same code, an empty memo.
    fast = ops.FastLaunch(kernel)
    ptrs = [t.data_ptr() if t is not None else 0 for t in tensors]

    def fast_launch():
        fast.launch(plan, tensors, ptrs)

    facts = {
        "PDL": plan.use_pdl,
        "direct launch supported": ops.DIRECT_LAUNCH,
        "launch hooks active (a profiler)": ops.hooks_active(),
    }
    # Top down: Triton's entry, our fast-path launch, the launcher objects below them.
    calls = {
        "kernel[grid](...) (Triton's entry)": lambda: kernel[grid](*args, **options),
        "FastLaunch.launch": fast_launch,
    }
    fast_launch()  # compiles and keeps the DirectLaunch (on a GPU)
    direct = plan.direct
    if direct is not None:
        facts["DirectLaunch calls the C launch (not compiled.run)"] = direct.launch is not getattr(
            direct.compiled, "run", None
        )
        calls["DirectLaunch, int pointers (the eager path's launch)"] = lambda: direct.launch(
            gx, gy, 1, stream, *direct.mid, *int_args
        )
    compiled = kernel[grid](*args, **options)
    if getattr(compiled, "run", None) is not None:  # a CompiledKernel, not a compile future
        # CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata,
        # launch_metadata, enter_hook, exit_hook, *args): JITFunction.run's own call.
        head = (compiled.function, compiled.packed_metadata, None, None, None)
        calls["compiled.run(...) (raw launcher)"] = lambda: compiled.run(
            gx, gy, 1, stream, *head, *args
        )
        calls["compiled.run(...) int pointers"] = lambda: compiled.run(
            gx, gy, 1, stream, *head, *int_args
        )
    calls.update(
        {
            "6x tensor.data_ptr()": lambda: [a.data_ptr() for a in args[:6]],
            "key of 3 tensors (shape, stride, dtype, device)": lambda: tuple(
                (t.shape, t.stride(), t.dtype, t.device) for t in (h, r, aux)
            ),
            "key of 3 tensors (shape, stride, dtype, get_device)": lambda: tuple(
                (t.shape, t.stride(), t.dtype, t.get_device()) for t in (h, r, aux)
            ),
            "torch.cuda.current_device()": torch.cuda.current_device,
        }
    )
    return calls, facts


def time_host_calls(
    calls: dict, device, num_calls: int = 2000, summary: Callable = statistics.median
) -> dict:
    """{name: host us per call}: ``summary`` of 5 chunks of ``num_calls // 5``
    calls each (``summary=list`` keeps the chunks)."""
    return {
        name: host_us_per_call(
            fn, num_calls, warmup=50, summary=summary, sync=device.type == "cuda"
        )
        for name, fn in calls.items()
    }


def measure_host_overhead(hidden_size: int, dtype, device, calls: int = 2000) -> dict:
    """Host microseconds per call in eager mode, T = 1 (the GPU never limits):
    the report's table, median of the chunks."""
    return time_host_calls(host_calls(hidden_size, dtype, device)[0], device, calls)


def run_host_breakdown(args, num_calls: int = 2000) -> dict:
    """``--host-breakdown`` (CUDA): where the host time of one eager
    ``add_capture`` call goes -- each layer's time (median and best chunk),
    facts about the launch path and a cProfile of the public call."""
    import cProfile
    import io
    import pstats

    device = torch.device("cuda")
    calls, facts = host_calls(args.hidden_size, DTYPES[args.dtype], device, breakdown=True)
    chunks = time_host_calls(calls, device, num_calls, summary=list)
    public = calls["add_capture (public, eager fast path)"]
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(num_calls):
        public()
    prof.disable()
    torch.cuda.synchronize()
    profile = io.StringIO()
    pstats.Stats(prof, stream=profile).sort_stats("tottime").print_stats(14)
    return {
        "host_us_per_call": {
            name: {"median_us": statistics.median(us), "best_us": min(us), "chunks_us": us}
            for name, us in chunks.items()
        },
        "facts": facts,
        "calls": num_calls,
        "profile": profile.getvalue(),
    }


def device_identity() -> dict:
    info = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if not torch.cuda.is_available():
        info["device"] = (
            f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
        )
        return info
    props = torch.cuda.get_device_properties(0)
    info.update(
        device=props.name,
        sm_count=props.multi_processor_count,
        memory_gib=round(props.total_memory / 2**30, 1),
    )
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


def free_bytes(device) -> int:
    """Device memory still usable: the driver's free memory plus the caching
    allocator's unused blocks, less MEMORY_MARGIN of the total."""
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return max(0, free + cached - int(MEMORY_MARGIN * total))


def pdl_report(has_gpu: bool) -> dict:
    """Whether our kernel's eager launches used PDL in this process, and why."""
    env = os.environ.get(PDL_ENV)
    if not has_gpu:
        return {"state": "n/a", "env": env, "why": "the CPU path launches no GPU kernel"}
    if pdl_enabled(torch.cuda.current_device()):
        return {
            "state": "on",
            "env": env,
            "why": f"{PDL_ENV} {'unset' if env is None else '= ' + env}",
        }
    return {
        "state": "off",
        "env": env,
        "why": f"{PDL_ENV} = 0" if env == "0" else "needs sm_90+ and Triton's PDL",
    }


def run_gpu(args) -> dict:
    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    hidden, captures = args.hidden_size, args.num_captures
    copy_2gib = measure_copy_roofline(device)
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    rows = []
    for num_tokens in progress(args.tokens, len(args.tokens), "T sweep"):
        # Every set has its own hidden, residual, weight and aux buffer: with
        # one shared aux buffer, steps at small T rewrote aux lines still dirty
        # in L2, a write discount that no forward step gets (the rest of the
        # model runs between two captures). Half the free memory at most: the
        # rest is for kept outputs and the copy roofline's buffers.
        aux_bytes = num_tokens * captures * hidden * elem
        set_bytes = 3 * aux_bytes + captures * hidden * elem  # h, r, aux; weights
        num_sets = rotation_sets(
            set_bytes,
            l2_bytes,
            args.rotate_l2,
            max_sets=MAX_SETS,
            budget_bytes=free_bytes(device) // 2,
        )
        sets = [make_inputs(num_tokens, hidden, captures, dtype, device) for _ in range(num_sets)]
        row = {
            "T": num_tokens,
            "input_sets": num_sets,
            "input_l2_multiple": num_sets * set_bytes / l2_bytes,
            "paths": {},
        }
        copies, steps = {}, []
        for path in args.paths:
            check_path(path, sets[0])
            kept = kept_bytes(path, num_tokens, hidden, captures, elem)
            steps_per_graph = graph_steps(num_sets, args.steps_per_graph, kept, free_bytes(device))
            # Fewer steps than sets only where kept outputs would not fit.
            steps = [build_step(path, s) for s in sets[:steps_per_graph]]
            graph_us = time_graph_replay(steps, steps_per_graph, args.replays)
            event_us = time_events(steps, args.reps)
            nbytes = bytes_moved(path, num_tokens, hidden, captures, elem)
            key = (nbytes, steps_per_graph)
            if key not in copies:
                pairs = rotation_sets(
                    nbytes,
                    l2_bytes,
                    args.rotate_l2,
                    max_sets=MAX_SETS,
                    budget_bytes=free_bytes(device),
                )
                copies[key] = measure_copy_graph(
                    nbytes,
                    dtype,
                    device,
                    num_pairs=pairs,
                    steps_per_graph=steps_per_graph,
                    replays=args.replays,
                )
                torch.cuda.empty_cache()
            copy, gbps = copies[key], nbytes / graph_us / 1e3
            row["paths"][path] = {
                "graph_us": graph_us,
                "event_us": event_us,
                "bytes": nbytes,
                "steps_per_graph": steps_per_graph,
                "input_sets": len(steps),
                "graph_gbps": gbps,
                "copy": copy,
                # bandwidths, not times: the copy rounds to whole elements
                "graph_pct_roofline": 100 * gbps / copy["gbps"],
                "graph_pct_copy_2gib": 100 * gbps / copy_2gib["gbps"],
            }
        # One extra write of the K slots: measured, and (as before) at the
        # 2 GiB copy's read + write rate.
        buffers = [
            torch.empty(num_tokens, captures, hidden, dtype=dtype, device=device)
            for _ in range(
                rotation_sets(
                    aux_bytes,
                    l2_bytes,
                    args.rotate_l2,
                    max_sets=MAX_SETS,
                    budget_bytes=free_bytes(device),
                )
            )
        ]
        row["write_floor"] = measure_write_floor(buffers, args.steps_per_graph, args.replays)
        row["extra_write_floor_us"] = aux_bytes / copy_2gib["gbps"] / 1e3
        paths = row["paths"]
        if "d" in paths:
            row["capture_cost_us"] = {
                p: paths[p]["graph_us"] - paths["d"]["graph_us"]
                for p in ("b", "e", "f")
                if p in paths
            }
            floor = row["write_floor"]["net_us"]
            row["capture_cost_x_floor"] = {
                p: cost / floor if floor > 0 else None for p, cost in row["capture_cost_us"].items()
            }
        if "k" in paths:  # against SGLang's own norm kernel on CUDA (FlashInfer)
            row.setdefault("capture_cost_us", {}).update(
                {
                    key: paths[p]["graph_us"] - paths["k"]["graph_us"]
                    for key, p in (("j", "j"), ("f_k", "f"), ("l_k", "l"))
                    if p in paths
                }
            )
            # each path's GPU time as a multiple of FlashInfer's norm alone
            row["x_k"] = {
                p: paths[p]["graph_us"] / paths["k"]["graph_us"] for p in paths if p != "k"
            }
        rows.append(row)
        del sets, steps, buffers, copies
        torch.cuda.empty_cache()
    host = measure_host_overhead(hidden, dtype, device)
    return {
        "copy_2gib_eager": copy_2gib,
        "l2_bytes": l2_bytes,
        "rows": rows,
        "host_us_per_call": host,
    }


def run_cpu(args) -> dict:
    """The ops' CPU path (torch) at small sizes; wall-clock median, min and max
    per point (the spread is part of the answer: CPU timings swing a lot)."""
    device = torch.device("cpu")
    dtype = DTYPES[args.dtype]
    rows = []
    for num_tokens in progress(args.tokens, len(args.tokens), "T sweep (CPU)"):
        x = make_inputs(num_tokens, args.hidden_size, args.num_captures, dtype, device)
        row = {"T": num_tokens, "paths": {}}
        for path in [p for p in args.paths if p not in GPU_ONLY_PATHS]:
            check_path(path, x)
            step = build_step(path, x)
            for _ in range(3):
                step()
            samples = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                step()
                samples.append((time.perf_counter() - t0) * 1e6)
            row["paths"][path] = {
                "wall_us": statistics.median(samples),
                "min_us": min(samples),
                "max_us": max(samples),
                "reps": len(samples),
            }
        rows.append(row)
    return {"rows": rows}


def select_paths(
    requested: list, has_gpu: bool, has_liger: bool, has_flashinfer: bool = False
) -> tuple:
    """(paths to run, {path: one-line reason} for every requested path not run)."""
    skipped = {}
    for p in requested:
        if p == "h" and not has_liger:
            skipped[p] = LIGER_MISSING
        elif p in "jk" and has_gpu and not has_flashinfer:
            skipped[p] = FLASHINFER_MISSING
        elif p in GPU_ONLY_PATHS and not has_gpu:
            skipped[p] = GPU_ONLY_PATHS[p]
    return [p for p in requested if p not in skipped], skipped


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(legend_lines(list(PATHS), {})),
    )
    p.add_argument(
        "--hidden-size",
        type=int,
        default=7168,
        help="H: 7168 DeepSeek-V3/Kimi-K2 (default), 4096 / 5120 Llama-class",
    )
    p.add_argument("--num-captures", type=int, default=3, help="K captured layers (default 3)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument(
        "--tokens",
        type=int,
        nargs="+",
        default=None,
        help="T values (default 1 2 4 .. 16384 on a GPU, 1 .. 256 on CPU)",
    )
    p.add_argument(
        "--paths",
        default="abcdefghijkl",
        help="which paths to run, as letters (default abcdefghijkl; g, h, j, k on a "
        "GPU only, h only where liger-kernel is installed, j and k where "
        "FlashInfer's norm loads: installed, or built from the kernel source "
        "in .gpu_bundle, see benchmarks/flashinfer_norm.py)",
    )
    p.add_argument("--reps", type=int, default=100, help="eager repetitions per point")
    add_graph_timing_arguments(
        p,
        replays=30,
        one_set_note="one set",
        steps_note="more where more buffer sets rotate, fewer only where kept outputs would "
        "not fit",
    )
    p.add_argument(
        "--pdl",
        choices=["env", "on", "off", "both"],
        default="env",
        help=f"PDL for our kernel's launches: as {PDL_ENV} says (default: on "
        "unless it is 0), on, off, or both in turn and compared; on / off / "
        "both rerun the script in child processes where the setting differs "
        "from this process's",
    )
    p.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(__file__), "out"),
        help="folder for the JSON and PNG (default benchmarks/out)",
    )
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument(
        "--host-breakdown",
        action="store_true",
        help="only the host time of an eager call, T = 1, layer by layer down the "
        "call stack, and a cProfile of it (GPU only; no sweep)",
    )
    args = p.parse_args(argv)
    if args.host_breakdown and args.pdl == "both":
        p.error("--host-breakdown measures one PDL setting: --pdl env, on or off")
    if args.steps_per_graph < 1:
        p.error("--steps-per-graph must be at least 1")
    letters = [c for c in args.paths if c not in ", "]  # "a,b,c" and "a b c" work too
    bad = sorted(set(letters) - set(PATHS))
    if bad:
        p.error(
            f"--paths {args.paths!r}: unknown path letter(s) {', '.join(bad)}; "
            f"valid letters: {''.join(PATHS)}"
        )
    if not letters:
        p.error(f"--paths: no path letter given; valid letters: {''.join(PATHS)}")
    # What the user asked for, in their order, once each; main() narrows
    # args.paths to what runs here and says why the rest does not.
    args.requested_paths = list(dict.fromkeys(letters))
    args.paths = list(args.requested_paths)
    return args


def host_breakdown_main(args, argv: list, info: dict) -> int:
    """``--host-breakdown``: the report, and its JSON next to the sweep's."""
    if not torch.cuda.is_available():
        print(
            "No GPU: --host-breakdown times eager CUDA launches (Triton's launcher layers); "
            "nothing measured."
        )
        return 0
    result = run_host_breakdown(args)
    result.update(
        pdl=pdl_report(True),
        config=vars(args),
        device=info,
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        command=" ".join([__file__] + argv),
    )
    print()
    print("\n".join(report.report_lines(result)))
    stem = output_stem(args, True, args.pdl) + "_host"
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {stem}.json")
    return 0


def pdl_from_env(environ=os.environ) -> str:
    """The PDL setting a process with this environment launches with ("on" or
    "off"), read as eagle_capture.ops reads it."""
    return "off" if environ.get(PDL_ENV, "1") == "0" else "on"


def output_stem(args, has_gpu: bool, pdl: str) -> str:
    suffix = "" if pdl == "env" else f"_pdl-{pdl}"
    return os.path.join(
        args.out, f"capture_latency_{'gpu' if has_gpu else 'cpu'}_H{args.hidden_size}{suffix}"
    )


def rerun_with_pdl(argv: list, mode: str) -> int:
    """Run this script again in a child process with PDL ``mode``. Not set in
    this process: eagle_capture.ops caches the setting at its first launch
    (``pdl_enabled``) and keeps it in every memoised launch plan. The trailing
    ``--pdl`` overrides any earlier one (argparse keeps the last)."""
    env = dict(os.environ, **{PDL_ENV: "1" if mode == "on" else "0"})
    sys.stdout.flush()
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--pdl", mode]
    return subprocess.run(cmd, env=env).returncode


def run_pdl_both(args, argv: list) -> int:
    """``--pdl both``: a child run with PDL on, one with it off, then the two
    side by side and one JSON holding both."""
    for mode in ("on", "off"):
        print(f"\n=== PDL {mode}: child run ===", flush=True)
        rc = rerun_with_pdl(argv, mode)
        if rc:
            print(f"the PDL-{mode} run failed (exit {rc})", file=sys.stderr)
            return rc
    has_gpu = torch.cuda.is_available()
    results = {}
    for mode in ("on", "off"):
        with open(output_stem(args, has_gpu, mode) + ".json") as f:
            results[mode] = json.load(f)
    both = {
        "pdl_on": results["on"],
        "pdl_off": results["off"],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join([__file__] + argv),
    }
    print()
    print("\n".join(report.report_lines(both)))
    stem = output_stem(args, has_gpu, "both")
    with open(stem + ".json", "w") as f:
        json.dump(both, f, indent=1)
    print(f"\nwrote {stem}.json")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    argv = sys.argv[1:] if argv is None else list(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.pdl == "both":
        return run_pdl_both(args, argv)
    if args.pdl in ("on", "off") and pdl_from_env() != args.pdl:
        return rerun_with_pdl(argv, args.pdl)
    has_gpu = torch.cuda.is_available()
    has_liger = "h" in args.paths and liger_fused_add_rmsnorm() is not None
    flashinfer_line = None
    if has_gpu and not args.host_breakdown and set("jk") & set(args.paths):
        flashinfer_line = flashinfer_load()[1]
    has_flashinfer = flashinfer_line is not None and flashinfer_fused_add_rmsnorm() is not None
    args.paths, skipped = select_paths(args.requested_paths, has_gpu, has_liger, has_flashinfer)
    info = device_identity()
    if flashinfer_line is not None:
        info["flashinfer"] = flashinfer_line
    print(
        f"device: {info['device']}  torch {info['torch']}  triton {info['triton']}"
        + (f"  driver {info.get('driver')}" if has_gpu else "")
    )
    if flashinfer_line is not None:  # which FlashInfer, or why none (a long line)
        print(f"FlashInfer (paths j, k): {flashinfer_line}")
    if args.host_breakdown:
        return host_breakdown_main(args, argv, info)
    if has_gpu:
        args.tokens = args.tokens or DEFAULT_TOKENS
        result = run_gpu(args)
        result.update(skipped=skipped, pdl=pdl_report(has_gpu))
    else:
        print(
            "No GPU: running the CPU path (torch implementation) on small sizes. "
            "GPU figures need a GPU."
        )
        args.tokens = args.tokens or [1, 4, 16, 64, 256]
        args.reps = min(args.reps, 20)
        result = run_cpu(args)
        result.update(skipped=skipped, pdl=pdl_report(has_gpu), warning=CPU_WARNING)
    result.update(
        config={k: v for k, v in vars(args).items()},
        device=info,
        date=time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        command=" ".join([__file__] + argv),
    )
    print()  # the report is made from the result alone (capture_report.py)
    print("\n".join(report.report_lines(result)))
    stem = output_stem(args, has_gpu, args.pdl)
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {stem}.json")
    if has_gpu and not args.no_plot:
        try:
            report.plot(result, args, stem + ".png")
            print(f"wrote {stem}.png")
        except ImportError:
            print("matplotlib not installed: no plot")
    elif not args.no_plot:
        print("no plot on CPU: it shows GPU figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
