"""GPU and host timers shared by the scripts in benchmarks/.

A module of the package, so that every script (``python benchmarks/<script>.py``,
``torchrun benchmarks/allreduce_capture.py``) and the tests import it the same
way as ``eagle_capture`` itself, with no ``sys.path`` set-up. Not part of the
capture API; nothing here runs at import (no CUDA initialisation).

* :func:`time_graph_replay` -- median GPU us per step from CUDA-graph replay;
* :func:`rotation_sets`, :func:`graph_steps` -- how many buffer sets a graph
  walks so that no step finds its inputs in L2, and how many steps it holds;
* :func:`measure_copy_graph` -- a ``copy_`` of a given byte count, timed like
  the steps it is a roofline for (graph replay, rotated buffers);
* :func:`measure_write_floor` -- write-only cost of a buffer's bytes (``fill_``);
* :func:`time_events` -- median us per eager step between CUDA events;
* :func:`measure_copy_roofline` -- the device-to-device copy bandwidth of this run;
* :func:`host_us_per_call` -- host us per call of an eager function.
"""

import functools
import math
import statistics
import time
from typing import Callable, Optional

import torch


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
    # Out-of-place steps (capture_latency.py's paths a, g, h) return fresh
    # outputs. Kept alive, each step of the graph writes to its own memory;
    # dropped, the graph pool would hand every step the same block, whose dirty
    # lines can be rewritten in L2 without ever reaching DRAM -- a write
    # discount no layer of a model gets (benchmarks/NOTES.md, "Output reuse in
    # graph replay").
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


def rotation_sets(
    set_bytes: int,
    l2_bytes: int,
    l2_multiple: float,
    *,
    max_sets: int,
    budget_bytes: Optional[int] = None,
) -> int:
    """Distinct buffer sets, each of ``set_bytes``, whose total is at least
    ``l2_multiple`` x L2, so that a step never reads what an earlier one left in
    cache (a model's layers read fresh activations). 1 for ``l2_multiple <= 0``
    (one set, warm cache). At most ``max_sets`` (each set is one graph step; the
    bound keeps the graph's size finite) and as many as ``budget_bytes`` holds."""
    if l2_multiple <= 0:
        return 1
    sets = math.ceil(l2_multiple * l2_bytes / max(1, set_bytes))
    if budget_bytes is not None:
        sets = min(sets, budget_bytes // max(1, set_bytes))
    return max(1, min(max_sets, sets))


def graph_steps(
    num_sets: int, min_steps: int, kept_bytes: int = 0, budget_bytes: Optional[int] = None
) -> int:
    """Steps per CUDA graph: at least ``min_steps`` (one replay's launch cost is
    shared by that many steps) and every set once (round-robin), but no more
    steps whose kept outputs (``kept_bytes`` each, see :func:`time_graph_replay`)
    exceed ``budget_bytes``; at least 1."""
    steps = max(min_steps, num_sets)
    if kept_bytes and budget_bytes is not None:
        steps = min(steps, budget_bytes // kept_bytes)
    return max(1, steps)


def measure_copy_graph(
    nbytes: int, dtype, device, *, num_pairs: int, steps_per_graph: int, replays: int
) -> dict:
    """A device copy (``dst = src + 0``) moving ``nbytes`` (read + written, rounded down to
    whole elements), timed as the steps it is a roofline for: CUDA-graph replay
    of ``steps_per_graph`` copies walking ``num_pairs`` (src, dst) pairs
    round-robin. Separate allocations: a row of a shared buffer could start
    misaligned and lose the copy kernel's vector loads."""
    elem = torch.tensor([], dtype=dtype).element_size()
    numel = max(1, nbytes // (2 * elem))
    pairs = [
        (
            torch.ones(numel, dtype=dtype, device=device),
            torch.empty(numel, dtype=dtype, device=device),
        )
        for _ in range(num_pairs)
    ]
    # An elementwise kernel, not copy_: captured in a CUDA graph, copy_ becomes a
    # memcpy node, which measured 2.77 TB/s on the H200 at 2.8 GB against 4.28
    # for the same copy run eagerly -- consistent with the graph handing it to a
    # copy engine instead of the SMs; the paths it is a roofline for run on SMs.
    steps = [lambda src=src, dst=dst: torch.add(src, 0, out=dst) for src, dst in pairs]
    us = time_graph_replay(steps, steps_per_graph, replays)
    moved = 2 * numel * elem
    return {
        "bytes": moved,
        "us": us,
        "gbps": moved / us / 1e3,
        "pairs": num_pairs,
        "steps_per_graph": max(steps_per_graph, num_pairs),
    }


def measure_write_floor(buffers: list, steps_per_graph: int, replays: int) -> dict:
    """Write-only time of one buffer's bytes: ``fill_`` of each buffer in turn,
    CUDA-graph replay (no reads: HBM writes are slower than reads, so a copy's
    read + write rate undercounts a write). The graph's per-kernel fixed cost
    (launch, ramp, tail) is measured with a one-row ``fill_`` of the same
    buffers and subtracted: ``net_us`` is the write alone, comparable with a
    store added inside an existing kernel."""
    us = time_graph_replay([lambda b=b: b.fill_(1) for b in buffers], steps_per_graph, replays)
    fixed = time_graph_replay(
        [lambda b=b: b[:1].fill_(1) for b in buffers], steps_per_graph, replays
    )
    nbytes = buffers[0].numel() * buffers[0].element_size()
    net = us - fixed
    return {
        "bytes": nbytes,
        "us": us,
        "fixed_us": fixed,
        "net_us": net,
        "gbps": nbytes / net / 1e3 if net > 0 else None,
        "buffers": len(buffers),
        "steps_per_graph": max(steps_per_graph, len(buffers)),
    }


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
    us = time_events([functools.partial(dst.copy_, src)], reps)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes": 2 * nbytes, "us": us, "gbps": 2 * nbytes / us / 1e3}


def host_us_per_call(
    fn: Callable[[], object],
    calls: int,
    *,
    warmup: int,
    summary: Callable = statistics.median,
    sync: bool = True,
    chunks: int = 5,
) -> float:
    """Host microseconds per call of ``fn``: ``warmup`` calls, then ``chunks``
    timed chunks of ``calls // chunks`` calls, reduced with ``summary`` (median,
    or min for the best chunk). With ``sync`` the GPU is drained after the
    warm-up and after each chunk, outside the timed region."""
    for _ in range(warmup):
        fn()
    if sync:
        torch.cuda.synchronize()
    per_chunk = calls // chunks
    samples = []
    for _ in range(chunks):
        t0 = time.perf_counter()
        for _ in range(per_chunk):
            fn()
        samples.append((time.perf_counter() - t0) * 1e6 / per_chunk)
        if sync:
            torch.cuda.synchronize()
    return summary(samples)


def add_graph_timing_arguments(parser, *, replays: int, steps_note: str, one_set_note: str) -> None:
    """The CUDA-graph timing options every benchmark script takes: --replays,
    --steps-per-graph and --rotate-l2 (see :func:`rotation_sets`, :func:`graph_steps`)."""
    parser.add_argument(
        "--replays", type=int, default=replays, help=f"graph replays per point (default {replays})"
    )
    parser.add_argument(
        "--steps-per-graph",
        type=int,
        default=8,
        help=f"at least this many steps per CUDA graph (default 8; {steps_note})",
    )
    parser.add_argument(
        "--rotate-l2",
        type=float,
        default=4,
        help=f"rotate buffer sets totalling this many L2 sizes (default 4; 0: "
        f"{one_set_note}, warm cache)",
    )
