"""GPU and host timers shared by the scripts in benchmarks/.

A module of the package, so that every script (``python benchmarks/<script>.py``,
``torchrun benchmarks/allreduce_capture.py``) and the tests import it the same
way as ``eagle_capture`` itself, with no ``sys.path`` set-up. Not part of the
capture API; nothing here runs at import (no CUDA initialisation).

* :func:`time_graph_replay` -- median GPU us per step from CUDA-graph replay;
* :func:`time_events` -- median us per eager step between CUDA events;
* :func:`measure_copy_roofline` -- the device-to-device copy bandwidth of this run;
* :func:`host_us_per_call` -- host us per call of an eager function.
"""

import statistics
import time
from typing import Callable

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


def host_us_per_call(fn: Callable[[], object], calls: int, *, warmup: int,
                     summary: Callable = statistics.median, sync: bool = True,
                     chunks: int = 5) -> float:
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
