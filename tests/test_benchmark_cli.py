"""benchmarks/capture_latency.py as a command: argument checks, the CPU run's
report, the GPU report's layout (fed a synthetic result, no GPU needed) and
the plot. Every printed line must fit 100 columns."""

import importlib.util
import json
import os
import re
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks", "capture_latency.py")
MAX_COLUMNS = 100


def _load():
    spec = importlib.util.spec_from_file_location("capture_latency", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["capture_latency"] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


cl = _load()


def assert_fits(lines):
    long = [line for line in lines if len(line) > MAX_COLUMNS]
    assert not long, f"{len(long)} line(s) over {MAX_COLUMNS} columns: {long[:3]}"


def gpu_args(paths="abcdefghi", **overrides):
    args = cl.parse_args(["--paths", paths])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def synthetic_gpu_result(paths="abcdefghi", tokens=tuple(2**i for i in range(15)),
                         scale=1.0):
    """The structure run_gpu builds, with made-up figures; ``scale`` inflates the
    times (wider cells). Path f beats d (negative cost) at every other T."""
    roofline = {"bytes": 4 << 30, "us": 2000.0, "gbps": 4277.0}
    rows = []
    for t in tokens:
        base = (2.0 + t * 0.04) * scale
        row = {"T": t, "input_sets": max(1, 16 // t), "paths": {}}
        for i, p in enumerate(paths):
            us = base * (1 + 0.15 * i)
            nbytes = int(us * roofline["gbps"] * 1e3 * 0.9)
            row["paths"][p] = {"graph_us": us, "event_us": us + 40.0, "bytes": nbytes,
                               "graph_gbps": nbytes / us / 1e3,
                               "graph_pct_roofline": 100 * nbytes / us / 1e3 / roofline["gbps"]}
        row["extra_write_floor_us"] = t * 0.01 * scale
        if "d" in row["paths"]:
            d = row["paths"]["d"]["graph_us"]
            row["capture_cost_us"] = {p: row["paths"][p]["graph_us"] - d
                                      for p in "bef" if p in row["paths"]}
            if "f" in row["capture_cost_us"] and t % 2 == 0:
                row["capture_cost_us"]["f"] = -0.3 * scale
        rows.append(row)
    host = {"torch.add(out=)": 9.0, "add_capture (public, eager fast path)": 15.9,
            "add_capture (torch.ops, dispatcher)": 136.2,
            "add_rmsnorm_capture (public)": 18.2, "add_rmsnorm_capture (torch.ops)": 186.7}
    return {"roofline": roofline, "rows": rows, "host_us_per_call": host}


# ---------------------------------------------------------------- arguments

@pytest.mark.parametrize("paths, bad", [("xz", "x, z"), ("abq", "q"), ("a-b", "-")])
def test_unknown_paths_exit_2(paths, bad, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        cl.main(["--paths", paths, "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown path letter(s) {bad}" in err
    assert "valid letters: abcdefghi" in err
    assert not list(tmp_path.iterdir()), "nothing may run or be written"


def test_empty_paths_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cl.parse_args(["--paths", ""])
    assert exc.value.code == 2
    assert "valid letters: abcdefghi" in capsys.readouterr().err


def test_paths_separators_and_repeats():
    assert cl.parse_args(["--paths", "a,c e"]).paths == ["a", "c", "e"]
    assert cl.parse_args(["--paths", "dad"]).requested_paths == ["d", "a"]


def test_select_paths_gives_every_skip_a_reason():
    run, skipped = cl.select_paths(list("abcdefghi"), has_gpu=False, has_liger=False)
    assert run == list("abcdefi")
    assert set(skipped) == {"g", "h"} and all(skipped.values())
    run, skipped = cl.select_paths(list("gh"), has_gpu=True, has_liger=False)
    assert run == ["g"] and "not installed" in skipped["h"]
    assert cl.select_paths(list("gh"), has_gpu=True, has_liger=True) == (["g", "h"], {})


def test_every_legend_and_reason_line_fits():
    reasons = list(cl.GPU_ONLY_PATHS.values()) + [cl.LIGER_MISSING]
    for reason in reasons:
        lines = cl.legend_lines(list(cl.PATHS), {p: reason for p in cl.PATHS})
        assert_fits(lines)
    assert set(cl.PATH_MEASURES) == set(cl.PATHS)


# ---------------------------------------------------------------- CPU run

def test_cpu_run_report(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path everywhere
    rc = cl.main(["--tokens", "1", "2", "--reps", "3", "--hidden-size", "64", "--no-plot",
                  "--out", str(tmp_path)])
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    assert_fits(lines)
    text = "\n".join(lines)

    # the legend, above the table
    legend_at = lines.index("Paths (key, what runs, what it measures):")
    table_at = next(i for i, line in enumerate(lines) if re.match(r"\s*T \| ", line))
    assert legend_at < table_at
    for p in "abcdefi":
        assert any(line.startswith(f"  {p}  {cl.PATHS[p]}") and cl.PATH_MEASURES[p] in line
                   for line in lines[legend_at:table_at]), p
    # a reason for each requested path that is not run
    for p in "gh":
        reason = [line for line in lines if line.startswith(f"  {p}  {cl.PATHS[p]}: ")]
        assert len(reason) == 1 and len(reason[0]) > len(f"  {p}  {cl.PATHS[p]}: ") + 10
    # the spread and the warning
    assert "min / median / max over 3 reps" in text
    assert any(line.startswith("WARNING: CPU figures are not performance figures")
               for line in lines[:table_at])
    spread = re.compile(r"\d+\.\d / +\d+\.\d / +\d+\.\d")
    for t in ("1", "2"):
        cells = [line for line in lines if re.match(rf"\s*{t} \| ", line)]
        assert cells and all(len(spread.findall(line)) >= 1 for line in cells)

    # JSON: the old keys kept, the new ones added
    result = json.loads((tmp_path / "capture_latency_cpu_H64.json").read_text())
    assert {"rows", "config", "device", "date", "command", "skipped"} <= set(result)
    assert set(result["skipped"]) == {"g", "h"}
    assert result["config"]["paths"] == list("abcdefi")
    assert result["config"]["requested_paths"] == list("abcdefghi")
    for row in result["rows"]:
        assert set(row) == {"T", "paths"} and set(row["paths"]) == set("abcdefi")
        for d in row["paths"].values():
            assert d["min_us"] <= d["wall_us"] <= d["max_us"] and d["reps"] == 3


def test_cpu_table_with_nothing_to_run():
    args = gpu_args("gh")
    args.paths = []  # what main() leaves after select_paths on a CPU without liger
    lines = cl.format_cpu_table({"rows": [{"T": 1, "paths": {}}],
                                 "skipped": {"g": cl.GPU_ONLY_PATHS["g"],
                                             "h": cl.LIGER_MISSING}}, args)
    assert lines[-1] == "No path to run."
    assert_fits(lines)


# ---------------------------------------------------------------- GPU report, no GPU

@pytest.mark.parametrize("scale", [1.0, 100.0])
@pytest.mark.parametrize("paths", ["abcdefghi", "abcdefgi", "adei", "f"])
def test_gpu_table_fits_and_keeps_everything(paths, scale):
    result = synthetic_gpu_result(paths, scale=scale)
    result["skipped"] = {"h": cl.LIGER_MISSING} if "h" not in paths else {}
    args = gpu_args(paths)
    lines = cl.format_gpu_table(result, args)
    assert_fits(lines)
    text = "\n".join(lines)
    legend_at = lines.index("Paths (key, what runs, what it measures):")
    table_at = next(i for i, line in enumerate(lines) if re.match(r"\s*T \| ", line))
    assert legend_at < table_at
    for p in paths:
        assert f"  {p}  {cl.PATHS[p]}" in text
        # a column headed by the letter, in a table header line
        assert any(re.match(r"\s*T \|", line) and re.search(rf"\| +{p}( |$)", line)
                   for line in lines), p
    if "h" not in paths:
        assert f"  h  {cl.PATHS['h']}: {cl.LIGER_MISSING}" in lines
    assert "cost b / e / f (floor) us" in text
    assert "[% of copy roofline]" in text
    # every T, median us and [% roofline] of every path, the cost cell
    for row in result["rows"]:
        t_lines = [line for line in lines if re.match(rf"\s*{row['T']} \| ", line)]
        for p in paths:
            d = row["paths"][p]
            assert any(f"{d['graph_us']:.1f} [{d['graph_pct_roofline']:3.0f}%]" in line
                       for line in t_lines), (row["T"], p)
            assert any(f"{d['event_us']:.1f}" in line for line in t_lines)
        floor = f"({row['extra_write_floor_us']:.1f})"
        assert any(line.endswith(floor) for line in t_lines)
        for p, cost in row.get("capture_cost_us", {}).items():
            assert any(f"{cost:+.1f}" in line for line in t_lines)
    for name in result["host_us_per_call"]:
        assert name in text


def test_pack_columns_wraps_and_repeats_key():
    columns = [(f"col{i}", ["x" * 20, "y" * 20]) for i in range(9)]
    lines = cl.pack_columns("T", ["1", "16384"], columns, width=60)
    assert_fits(lines)
    assert max(len(line) for line in lines) <= 60
    headers = [line for line in lines if line.lstrip().startswith("T |")]
    assert len(headers) == 5  # 2 columns (3 + 20 wide) per block after the key column
    assert sum(line.count("col") for line in headers) == 9


# ---------------------------------------------------------------- plot

def test_plot_marks_non_positive_costs(tmp_path, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figures = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig) or real_close(fig))
    result = synthetic_gpu_result(tokens=(1, 2, 4, 8, 16))
    out = tmp_path / "capture.png"
    cl.plot(result, gpu_args(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    cost_ax = fig.axes[1]
    assert cost_ax.get_yscale() == "symlog"
    marked = [tuple(xy) for c in cost_ax.collections for xy in c.get_offsets()]
    negative = [(r["T"], r["capture_cost_us"]["f"]) for r in result["rows"]
                if r["capture_cost_us"]["f"] <= 0]
    assert negative and all(point in marked for point in negative)
    for line in cost_ax.get_lines():  # costs drawn at their value, not clipped
        if line.get_label().startswith("f:"):
            assert min(line.get_ydata()) == pytest.approx(-0.3)


def test_host_timer_runs_warmup_then_chunks_and_summarises():
    from eagle_capture.bench import host_us_per_call
    calls = []
    us = host_us_per_call(lambda: calls.append(1), 103, warmup=7, summary=min, sync=False)
    assert len(calls) == 7 + 5 * (103 // 5) and us > 0
