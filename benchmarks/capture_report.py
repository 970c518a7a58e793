"""The capture benchmark's report, made from its JSON alone: the tables (100
columns at most, path letters keyed by a legend) and the plot.

    python benchmarks/capture_report.py benchmarks/results/capture_latency_gpu_H7168.json
    python benchmarks/capture_report.py RESULT.json --plot RESULT.png

``capture_latency.py`` measures and writes the JSON, then prints this report;
a saved run can be reported again, or differently, without a GPU.
"""

import argparse
import json
import sys
from types import SimpleNamespace

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
    "j": "FlashInfer add+RMSNorm + copy_",
    "k": "FlashInfer add+RMSNorm (no capture)",
    "l": "f, norm of fp32 sum (SGLang drop-in)",
}

# What each path's figure tells the reader (the legend's last column).
PATH_MEASURES = {
    "a": "SGLang <= 0.5.13's capture: h + r per layer, then cat",
    "b": "SGLang >= 0.5.18's capture: the norm, then a copy_",
    "c": "the capture alone, fused: add + store, no norm",
    "d": "baseline: the layer's own add+RMSNorm, no capture",
    "e": "d + a store of the residual into the slot",
    "f": "d whose residual output is the slot: no extra write",
    "g": "Inductor's kernel for d: the one to beat",
    "h": "Liger-Kernel's kernel for d",
    "i": "e, normalising the fp32 sum (SGLang drop-in's kernel)",
    "j": "SGLang >= 0.5.18's capture on CUDA as it runs",
    "k": "SGLang's norm on CUDA (FlashInfer), no capture",
    "l": "f, normalising the fp32 sum (the drop-in's call)",
}

WIDTH = 100  # every printed line fits this many columns (tests/test_benchmark_cli.py)

CPU_WARNING = "WARNING: CPU figures are not performance figures: timings swing between runs"

# A capture cost is shown as a multiple of the write floor only where the floor
# is this many us: below it, graph-replay jitter is a large part of the floor.
FLOOR_MIN_US = 1.0

PDL_PATHS = "bcdefil"  # launch our kernel through the eager entry points

# Paths the CPU run leaves out, and why (printed under "Not run").
GPU_ONLY_PATHS = {
    "g": "GPU only (on CPU it would time Inductor's C++ code)",
    "h": "GPU only (Liger-Kernel's kernels are Triton GPU kernels)",
    "j": "GPU only (FlashInfer's norm is a CUDA kernel)",
    "k": "GPU only (FlashInfer's norm is a CUDA kernel)",
}
LIGER_MISSING = "liger-kernel is not installed (pip install liger-kernel)"
FLASHINFER_MISSING = (
    "FlashInfer's norm does not load here (not installed, no bundle to "
    "build it from, or its build failed)"
)


def legend_lines(paths: list, skipped: dict) -> list:
    """The key to the table's columns, one line per path, then the reason for
    every requested path that is not run."""
    lines = []
    if paths:
        w = max(len(PATHS[p]) for p in paths)
        lines.append("Paths (key, what runs, what it measures):")
        lines += [f"  {p}  {PATHS[p]:<{w}}  {PATH_MEASURES[p]}" for p in paths]
    if skipped:
        lines.append("Not run:")
        lines += [f"  {p}  {PATHS[p]}: {why}" for p, why in skipped.items()]
    return lines


def align_parts(parts: list) -> list:
    """Right-align each position of equal-length string lists to that position's
    widest entry (so that e.g. "min / median / max" line up down a column)."""
    widths = [max(len(row[i]) for row in parts) for i in range(len(parts[0]))] if parts else []
    return [[x.rjust(w) for x, w in zip(row, widths)] for row in parts]


def pack_columns(
    key_header: str, keys: list, columns: list, width: int = WIDTH, sep: str = " | "
) -> list:
    """A table of right-aligned columns, ``columns`` = [(header, [cell per key])],
    laid out in blocks of at most ``width`` characters: the key column (T) starts
    every block and the columns that do not fit go on to the next block."""
    key_w = max([len(key_header)] + [len(k) for k in keys])
    blocks, block, used = [], [], key_w
    for header, cells in columns:
        w = max([len(header)] + [len(c) for c in cells])
        if block and used + len(sep) + w > width:
            blocks.append(block)
            block, used = [], key_w
        block.append((header, cells, w))
        used += len(sep) + w
    if block:
        blocks.append(block)
    lines = []
    for i, block in enumerate(blocks):
        if i:
            lines.append("")
        head = key_header.rjust(key_w) + "".join(sep + h.rjust(w) for h, _, w in block)
        lines += [head, "-" * len(head)]
        lines += [
            key.rjust(key_w) + "".join(sep + cells[r].rjust(w) for _, cells, w in block)
            for r, key in enumerate(keys)
        ]
    return lines


def pdl_line(pdl: dict, paths: list) -> str:
    """One line: whether this run's PDL-capable paths launched with PDL."""
    if pdl["state"] == "n/a":
        return f"PDL: n/a ({pdl['why']})."
    ours = " ".join(p for p in paths if p in PDL_PATHS) or "no path here"
    never = " ".join(p for p in paths if p not in PDL_PATHS)
    return (
        f"PDL: {pdl['state']} ({pdl['why']}) for {ours}"
        + (f"; {never} cannot use it" if never else "")
        + "."
    )


def format_ratio(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def format_gpu_table(result: dict, args) -> list:
    """The GPU report as lines of at most WIDTH characters (pure: no GPU needed)."""
    roof, rows, paths = result["copy_2gib_eager"], result["rows"], list(args.paths)
    l2_multiple = min((row["input_l2_multiple"] for row in rows), default=0.0)
    lines = [
        "Roofline ([%] cells): one copy kernel (src + 0) moving the path's bytes at that T, "
        "timed as",
        "the paths are (graph replay, same steps per graph, rotated buffers).",
        f"2 GiB eager copy (secondary): {roof['gbps']:.0f} GB/s read + written.",
        f"H = {args.hidden_size}, K = {args.num_captures} captured layers, {args.dtype}; "
        f">= {args.steps_per_graph} steps per CUDA graph, each step on the next",
        f"of N buffer sets (h, r, w, aux) that total >= {l2_multiple:.1f} x L2 "
        f"({result['l2_bytes'] / 2**20:.0f} MiB) at every T.",
        pdl_line(result["pdl"], paths),
        "",
    ]
    lines += legend_lines(paths, result.get("skipped", {}))
    lines += [
        "",
        "Cells: GPU us per forward step (all K layers), CUDA-graph replay, median "
        "[% of same-size copy].",
        "cost b / e / f: us over path d (the capture's own cost). floor: one write of the K slots'",
        "bytes, measured: fill_ of a rotated [T, K, H] buffer in graph replay less a one-row fill_",
        f"(the launch's fixed cost). x floor: cost / floor, where the floor >= "
        f"{FLOOR_MIN_US:g} us.",
        "j-k: SGLang's capture over its own FlashInfer norm; f-k: the drop-in's norm -> "
        "slot over it.",
        "",
    ]
    keys = [str(row["T"]) for row in rows]
    columns = [
        (
            p,
            [
                f"{row['paths'][p]['graph_us']:.1f} [{row['paths'][p]['graph_pct_roofline']:3.0f}%]"
                for row in rows
            ],
        )
        for p in paths
    ]
    costs = align_parts(
        [
            [
                f"{row['capture_cost_us'][p]:+.1f}" if p in row.get("capture_cost_us", {}) else "-"
                for p in "bef"
            ]
            for row in rows
        ]
    )
    columns.append(("cost b / e / f us", [" / ".join(c) for c in costs]))
    columns.append(("floor us", [f"{row['write_floor']['net_us']:.1f}" for row in rows]))
    ratios = align_parts(
        [
            [
                format_ratio(row.get("capture_cost_x_floor", {}).get(p))
                if row["write_floor"]["net_us"] >= FLOOR_MIN_US
                else "-"
                for p in "bef"
            ]
            for row in rows
        ]
    )
    columns.append(("x floor b / e / f", [" / ".join(r) for r in ratios]))
    if any("j" in row.get("capture_cost_us", {}) for row in rows):
        # Against what SGLang runs on CUDA: its capture's cost over its own norm (j - k),
        # and ours in place of both (f - k: the drop-in's norm and capture vs SGLang's norm).
        vs = align_parts(
            [
                [
                    f"{row['capture_cost_us'][p]:+.1f}"
                    if p in row.get("capture_cost_us", {})
                    else "-"
                    for p in ("j", "f_k")
                ]
                for row in rows
            ]
        )
        columns.append(("j-k / f-k us", [" / ".join(c) for c in vs]))
    lines += pack_columns("T", keys, columns)
    ours = [p for p in paths if p in "dfil" and any(p in row.get("x_k", {}) for row in rows)]
    if ours:
        lines += [
            "",
            "Against FlashInfer's norm alone (k): GPU time / k's, graph replay "
            "(<= 1.000: at or below it).",
        ]
        lines += pack_columns(
            "T",
            keys,
            [
                (
                    f"{p} / k",
                    [
                        "-" if row.get("x_k", {}).get(p) is None else f"{row['x_k'][p]:.3f}"
                        for row in rows
                    ],
                )
                for p in ours
            ],
        )
    if paths:
        lines += ["", "Eager (CUDA events, launch overhead included), us per step:"]
        lines += pack_columns(
            "T", keys, [(p, [f"{row['paths'][p]['event_us']:.1f}" for row in rows]) for p in paths]
        )
    lines += ["", "Host time per op call, eager, T = 1 (us):"]
    lines += [f"  {name:<42} {us:6.1f}" for name, us in result["host_us_per_call"].items()]
    return lines


def format_pdl_comparison(on: dict, off: dict) -> list:
    """``--pdl both``: the two runs side by side, "on / off" per path and T
    (graph-replay median on a GPU, wall-clock median on the CPU)."""
    gpu = "copy_2gib_eager" in on
    figure = "graph_us" if gpu else "wall_us"
    paths = [p for p in on["config"]["paths"] if p in off["config"]["paths"]]
    lines = [
        f"PDL on vs off: two runs of this script, us per step "
        f"({'CUDA-graph replay' if gpu else 'CPU wall clock'}, median), on / off.",
        f"on run: {pdl_line(on['pdl'], paths)}",
        f"off run: {pdl_line(off['pdl'], paths)}",
    ]
    if any(p not in PDL_PATHS for p in paths):
        lines.append("Paths that never use PDL: their on / off difference is run-to-run noise.")
    lines.append("")
    off_rows = {row["T"]: row for row in off["rows"]}
    rows = [row for row in on["rows"] if row["T"] in off_rows]
    columns = []
    for p in paths:
        cells = align_parts(
            [
                [f"{row['paths'][p][figure]:.1f}", f"{off_rows[row['T']]['paths'][p][figure]:.1f}"]
                for row in rows
            ]
        )
        columns.append((p, [" / ".join(c) for c in cells]))
    return lines + pack_columns("T", [str(row["T"]) for row in rows], columns)


def cpu_spread(result: dict) -> float:
    """The largest max/min ratio over all points of a CPU run (1.0 if none)."""
    ratios = [
        d["max_us"] / d["min_us"]
        for row in result["rows"]
        for d in row["paths"].values()
        if d.get("min_us", 0) > 0
    ]
    return max(ratios, default=1.0)


def format_cpu_table(result: dict, args) -> list:
    """The CPU report as lines of at most WIDTH characters."""
    rows, paths = result["rows"], [p for p in args.paths if p not in GPU_ONLY_PATHS]
    lines = [
        f"CPU path (the ops' torch implementation), H = {args.hidden_size}, "
        f"K = {args.num_captures} captured layers, {args.dtype}."
    ]
    if "pdl" in result:
        lines.append(pdl_line(result["pdl"], paths))
    lines.append("")
    lines += legend_lines(paths, result.get("skipped", {}))
    if not paths:
        return lines + ["", "No path to run."]
    spread = cpu_spread(result)
    lines += [
        "",
        f"Cells: wall-clock us per step (all K layers): min / median / max over {args.reps} reps.",
        f"{CPU_WARNING} (max/min {spread:.{1 if spread < 10 else 0}f}x here).",
        "",
    ]
    columns = []
    for p in paths:
        parts = align_parts(
            [
                [
                    f"{row['paths'][p]['min_us']:.1f}",
                    f"{row['paths'][p]['wall_us']:.1f}",
                    f"{row['paths'][p]['max_us']:.1f}",
                ]
                for row in rows
            ]
        )
        columns.append((p, [" / ".join(c) for c in parts]))
    return lines + pack_columns("T", [str(row["T"]) for row in rows], columns)


def plot(result: dict, args, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    tokens = [r["T"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    for p in args.paths:
        ax1.plot(
            tokens,
            [r["paths"][p]["graph_us"] for r in rows],
            marker="o",
            ms=3,
            label=f"{p}: {PATHS[p]}",
        )
    ax1.set(
        xscale="log",
        yscale="log",
        xlabel="tokens T",
        ylabel="GPU us per step (graph replay)",
        title=f"Capture of K={args.num_captures} layers, H={args.hidden_size}, {args.dtype}",
    )
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    # A capture cost can be zero or negative (f often ties d, within noise). A
    # log axis cannot show those, and clipping them to a small floor drew them
    # as tiny positive costs. So: a symlog axis (linear within +-1 us, log
    # beyond), every cost at its true value, a zero line, and each cost <= 0
    # circled in red so that it cannot be mistaken for a small positive one.
    nonpositive = False
    for p in ("b", "e", "f"):
        if all(p in r.get("capture_cost_us", {}) for r in rows):
            costs = [r["capture_cost_us"][p] for r in rows]
            ax2.plot(tokens, costs, marker="o", ms=3, label=f"{p}: {PATHS[p]}")
            low = [(t, c) for t, c in zip(tokens, costs) if c <= 0]
            if low:
                ax2.scatter(
                    *zip(*low),
                    s=60,
                    facecolors="none",
                    edgecolors="red",
                    zorder=3,
                    label=None if nonpositive else "cost <= 0 (no slower than d)",
                )
                nonpositive = True
    ax2.plot(
        tokens,
        [r["write_floor"]["net_us"] for r in rows],
        "k--",
        label="one extra write, measured (fill_, launch cost removed)",
    )
    ax2.axhline(0, color="grey", lw=0.8)
    ax2.set_xscale("log")
    ax2.set_yscale("symlog", linthresh=1.0)
    ax2.set(
        xlabel="tokens T",
        ylabel="capture cost over d (us; symlog, linear within +-1)",
        title="Capture overhead vs the layer's add+RMSNorm",
    )
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_host_breakdown(result: dict, args) -> list:
    """The ``--host-breakdown`` report as lines (the cProfile's own lines last)."""
    rows = result["host_us_per_call"]
    w = max(len(name) for name in rows)
    lines = [
        f"Host time per eager call, T = 1, H = {args.hidden_size}, {args.dtype}; "
        f"{result['calls']} calls in 5 chunks:"
    ]
    lines += [f"  {fact}: {value}" for fact, value in result["facts"].items()]
    lines += ["", f"  {'us per call':<{w}}  {'median':>7}  {'best':>7}"]
    lines += [
        f"  {name:<{w}}  {d['median_us']:7.2f}  {d['best_us']:7.2f}" for name, d in rows.items()
    ]
    return lines + [
        "",
        f"cProfile of {result['calls']} public add_capture calls:",
        result["profile"].strip("\n"),
    ]


def report_lines(result: dict) -> list:
    """The report of one JSON (a sweep on a GPU or the CPU, ``--pdl both``, or
    ``--host-breakdown``), as printed lines."""
    if "pdl_on" in result:
        return format_pdl_comparison(result["pdl_on"], result["pdl_off"])
    args = SimpleNamespace(**result["config"])
    if "facts" in result:
        return format_host_breakdown(result, args)
    if "copy_2gib_eager" in result:
        return format_gpu_table(result, args)
    return format_cpu_table(result, args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", help="a JSON written by benchmarks/capture_latency.py")
    p.add_argument("--plot", metavar="PNG", help="also draw the GPU sweep's plot here")
    args = p.parse_args(argv)
    with open(args.result) as f:
        result = json.load(f)
    print("\n".join(report_lines(result)))
    if args.plot:
        if "copy_2gib_eager" not in result:
            p.error("--plot draws a GPU sweep; this JSON holds none")
        plot(result, SimpleNamespace(**result["config"]), args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
