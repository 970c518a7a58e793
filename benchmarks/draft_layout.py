"""What the aux buffer's layout costs a forward step end to end: the K = 3 captures
plus the draft's first layer, the GEMM ``fc`` that maps the captured [T, 3H] to H.

The engines' EAGLE-3 drafts read the capture as one [T, 3H] matrix (the slots of
a token side by side, "interleaved"): ``fc`` is then a single GEMM. Storing each
slot's rows contiguously instead ("slot-major", [3, T, H]) makes the capture's
slot store cheaper at large T (benchmarks/NOTES.md), but no single GEMM reads
that storage as [T, 3H]: the best a draft could do with cuBLAS is three GEMMs
accumulating into one output, ``x0 W0^T + x1 W1^T + x2 W2^T`` (W_k the k-th H
columns of fc's weight). Per H and T this script times, under CUDA-graph
replay (medians, buffer sets rotated past 4 x L2 as in tune_kernel.py; --rounds
times each cell again with the layouts in the other order, and takes the median):

  capture     the three in-slot launches of the SGLang drop-in (tune_kernel's
              ``l pdl``, the production kernel), in each layout
  fc          the draft's first GEMM in each layout (bf16 in and out)
  step        both, one after the other in one graph step

and prints slot-major minus interleaved for each. Without a GPU it says so and
exits 0. Results: benchmarks/RESULTS.md, benchmarks/NOTES.md.
"""

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tune_kernel as tk  # noqa: E402  (the capture's launch, buffer sets and check)

from eagle_capture.testing.bench import (  # noqa: E402
    add_graph_timing_arguments,
    rotation_sets,
    time_graph_replay,
)

LAYOUTS = {
    "interleaved": tk.Variant("l pdl", "l", pdl=True),
    "slot-major": tk.Variant("l slot-major", "l", pdl=True, aux_layout="slot-major"),
}
DEFAULT_TOKENS = [1, 64, 1024, 4096, 16384]
WHAT = ("capture", "fc", "step")


def slots_of(layout: str, aux: torch.Tensor, hidden_size: int) -> torch.Tensor:
    """The captured rows as the draft would read them: [T, 3H] (interleaved) or
    [3, T, H] (slot-major), views of the aux storage ``aux``."""
    T = aux.shape[0]
    dense = aux.view(-1)[: T * tk.SLOTS * hidden_size]
    if layout == "interleaved":
        return dense.view(T, tk.SLOTS * hidden_size)
    return dense.view(tk.SLOTS, T, hidden_size)


def draft_fc(layout: str, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """The draft's fc into ``out`` [T, H]: one GEMM over [T, 3H], or the sum of three
    GEMMs over the slot-major [3, T, H] (the first writes, the others accumulate)."""
    if layout == "interleaved":
        torch.mm(x, weight.t(), out=out)
        return
    H = out.shape[1]
    torch.mm(x[0], weight[:, :H].t(), out=out)
    for k in range(1, tk.SLOTS):
        out.addmm_(x[k], weight[:, k * H : (k + 1) * H].t())


def check_fc(weight: torch.Tensor, one_set: tk.BufferSet, hidden_size: int) -> float:
    """Both layouts' fc over the same captured values; returns their relative
    difference (bf16 GEMMs: rounding only). Raises AssertionError above 1%."""
    x = torch.randn(one_set.h.shape[0], tk.SLOTS * hidden_size, device=weight.device)
    x = x.to(weight.dtype)
    outs = {}
    for layout in LAYOUTS:
        aux = torch.empty_like(one_set.aux)
        view = slots_of(layout, aux, hidden_size)
        if layout == "interleaved":
            view.copy_(x)
        else:
            view.copy_(x.view(-1, tk.SLOTS, hidden_size).transpose(0, 1))
        outs[layout] = torch.empty(x.shape[0], hidden_size, device=x.device, dtype=x.dtype)
        draft_fc(layout, view, weight, outs[layout])
    a, b = (outs[k].double() for k in LAYOUTS)
    rel = ((a - b).norm() / a.norm().clamp_min(1e-30)).item()
    if not rel <= 1e-2:
        raise AssertionError(f"the two layouts' fc differ by {rel:.2e} (relative)")
    return rel


def measure(args, hidden_size: int, T: int) -> dict:
    """{what: {layout: us per step}} at one H and T: the median over --rounds of
    each cell's median, the layouts timed in turn, first one then the other (a
    GEMM-bound step drifts with the GPU's clocks: one order would favour one)."""
    device, dtype = torch.device("cuda"), tk.DTYPES[args.dtype]
    elem = torch.tensor([], dtype=dtype).element_size()
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    one_set = tk.set_bytes(T, hidden_size, elem, False) + T * hidden_size * elem  # + fc out
    free, _ = torch.cuda.mem_get_info(device)
    weight = (torch.randn(hidden_size, tk.SLOTS * hidden_size, device=device) * 0.01).to(dtype)
    num_sets = max(
        2 * tk.SLOTS,
        rotation_sets(
            one_set, l2_bytes, args.rotate_l2, max_sets=tk.MAX_SETS, budget_bytes=free // 3
        ),
    )
    sets = [tk.make_set(T, hidden_size, dtype, device, False) for _ in range(num_sets)]
    for one in sets:  # finite values for the fc-only timing (the captures fill them too)
        one.aux.normal_()
    outs = [torch.empty(T, hidden_size, device=device, dtype=dtype) for _ in sets]
    check_fc(weight, sets[0], hidden_size)
    steps = {}
    for layout, v in LAYOUTS.items():
        shape = v.launch_shape(hidden_size)
        tk.check_variant(v, shape, sets[0])
        capture = tk.graph_steps_of(v, shape, sets, tk.SLOTS)

        def fc(i, layout=layout):
            draft_fc(layout, slots_of(layout, sets[i].aux, hidden_size), weight, outs[i])

        steps[layout] = {
            "capture": capture,
            "fc": [lambda i=i, fc=fc: fc(i) for i in range(num_sets)],
            "step": [lambda i=i, c=capture, fc=fc: (c[i](), fc(i)) for i in range(num_sets)],
        }
    times = {what: {layout: [] for layout in LAYOUTS} for what in WHAT}
    for r in range(args.rounds):
        for layout in list(LAYOUTS)[:: 1 if r % 2 == 0 else -1]:
            for what in WHAT:
                us = time_graph_replay(steps[layout][what], args.steps_per_graph, args.replays)
                times[what][layout].append(us)
    return {
        what: {layout: statistics.median(t) for layout, t in by_layout.items()}
        for what, by_layout in times.items()
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hidden-size", type=int, nargs="+", default=[7168, 2880])
    p.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    add_graph_timing_arguments(
        p,
        replays=20,
        one_set_note="one set per step",
        steps_note="every buffer set once where there are more",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="time every cell this many times, the layouts' order reversed each round; "
        "cells are the median (default 2)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the cells to PATH")
    args = p.parse_args(argv)
    if min(min(args.hidden_size), min(args.tokens), args.replays, args.rounds) < 1:
        p.error("--hidden-size, --tokens, --replays and --rounds must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("draft_layout: no CUDA GPU here, nothing measured (CUDA-graph timings).")
        return 0
    if tk.pdl_unavailable():
        print(f"draft_layout: the shipped launch needs PDL: {tk.pdl_unavailable()}")
        return 0
    props = torch.cuda.get_device_properties(0)
    device = f"{props.name}  torch {torch.__version__}  triton {tk.triton.__version__}"
    print(f"device: {device}; {args.dtype}; K = {tk.SLOTS}; us per step (median)")
    head = f"{'H':>5} {'T':>6} " + " ".join(
        f"{what + ' ' + lay[:5]:>14}" for what in WHAT for lay in LAYOUTS
    )
    print(head + f" {'step: slot-major - interleaved':>31}", flush=True)
    table = {}
    for H in args.hidden_size:
        for T in args.tokens:
            cells = measure(args, H, T)
            torch.cuda.empty_cache()  # the cell's buffers, before the next T's
            table.setdefault(H, {})[T] = cells
            line = " ".join(f"{cells[what][lay]:14.2f}" for what in WHAT for lay in LAYOUTS)
            step = cells["step"]
            delta = step["slot-major"] - step["interleaved"]
            print(
                f"{H:>5} {T:>6} {line} {delta:+16.2f} us ({delta / step['interleaved']:+.1%})",
                flush=True,
            )
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"device": device, "config": vars(args), "us": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
