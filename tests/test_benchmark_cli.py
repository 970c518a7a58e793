"""benchmarks/capture_latency.py as a command (argument checks and exit codes, the
CPU run, the sweep plan, PDL reruns) and capture_report.py (its tables rebuilt from a
recorded H200 JSON, the cost-per-floor rule, the plot). Printed lines fit 100 columns."""

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
report = sys.modules["capture_report"]


def assert_fits(lines):
    long = [line for line in lines if len(line) > MAX_COLUMNS]
    assert not long, f"{len(long)} line(s) over {MAX_COLUMNS} columns: {long[:3]}"


def gpu_args(paths="abcdefghi", **overrides):
    args = cl.parse_args(["--paths", paths])
    for name, value in overrides.items():
        setattr(args, name, value)
    return args


def synthetic_gpu_result(
    paths="abcdefghi", tokens=tuple(2**i for i in range(15)), scale=1.0, pdl_state="on"
):
    """The structure run_gpu builds (plus main's "skipped" and "pdl"), with
    made-up figures; ``scale`` inflates the times (wider cells). Path f beats d
    (negative cost) at every other T."""
    copy_2gib = {"bytes": 4 << 30, "us": 2000.0, "gbps": 4277.0}
    rows = []
    for t in tokens:
        base = (2.0 + t * 0.04) * scale
        row = {
            "T": t,
            "input_sets": max(1, 1463 // t),
            "input_l2_multiple": 4.0 + t / 1000,
            "paths": {},
        }
        for i, p in enumerate(paths):
            us = base * (1 + 0.15 * i)
            nbytes = int(us * copy_2gib["gbps"] * 1e3 * 0.9)
            copy_gbps = copy_2gib["gbps"] * 0.8
            gbps = nbytes / us / 1e3
            row["paths"][p] = {
                "graph_us": us,
                "event_us": us + 40.0,
                "bytes": nbytes,
                "steps_per_graph": max(8, row["input_sets"]),
                "input_sets": row["input_sets"],
                "graph_gbps": gbps,
                "copy": {"bytes": nbytes, "us": nbytes / copy_gbps / 1e3, "gbps": copy_gbps},
                "graph_pct_roofline": 100 * gbps / copy_gbps,
                "graph_pct_copy_2gib": 100 * gbps / copy_2gib["gbps"],
            }
        floor = t * 0.012 * scale
        row["write_floor"] = {"us": floor + 2.0, "fixed_us": 2.0, "net_us": floor}
        row["extra_write_floor_us"] = t * 0.01 * scale
        if "d" in row["paths"]:
            d = row["paths"]["d"]["graph_us"]
            row["capture_cost_us"] = {
                p: row["paths"][p]["graph_us"] - d for p in "bef" if p in row["paths"]
            }
            if "f" in row["capture_cost_us"] and t % 2 == 0:
                row["capture_cost_us"]["f"] = -0.3 * scale
            row["capture_cost_x_floor"] = {p: c / floor for p, c in row["capture_cost_us"].items()}
        if "k" in row["paths"]:
            k = row["paths"]["k"]["graph_us"]
            row.setdefault("capture_cost_us", {}).update(
                {
                    key: row["paths"][p]["graph_us"] - k
                    for key, p in (("j", "j"), ("f_k", "f"), ("l_k", "l"))
                    if p in row["paths"]
                }
            )
            row["x_k"] = {p: row["paths"][p]["graph_us"] / k for p in row["paths"] if p != "k"}
        rows.append(row)
    host = {
        "torch.add(out=)": 9.0,
        "add_capture (public, eager fast path)": 15.9,
        "add_capture (torch.ops, dispatcher)": 136.2,
        "add_rmsnorm_capture (public)": 18.2,
        "add_rmsnorm_capture (torch.ops)": 186.7,
    }
    why = {"on": "EAGLE_CAPTURE_PDL unset", "off": "EAGLE_CAPTURE_PDL = 0"}[pdl_state]
    return {
        "copy_2gib_eager": copy_2gib,
        "l2_bytes": 60 << 20,
        "rows": rows,
        "host_us_per_call": host,
        "pdl": {"state": pdl_state, "env": None, "why": why},
        "config": {"paths": list(paths)},
    }


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize("paths, bad", [("xz", "x, z"), ("abq", "q"), ("a-b", "-")])
def test_unknown_paths_exit_2(paths, bad, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        cl.main(["--paths", paths, "--out", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"unknown path letter(s) {bad}" in err
    assert "valid letters: abcdefghijkl" in err
    assert not list(tmp_path.iterdir()), "nothing may run or be written"


def test_empty_paths_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        cl.parse_args(["--paths", ""])
    assert exc.value.code == 2
    assert "valid letters: abcdefghijkl" in capsys.readouterr().err


def test_steps_per_graph_must_be_positive(capsys):
    with pytest.raises(SystemExit) as exc:
        cl.parse_args(["--steps-per-graph", "0"])
    assert exc.value.code == 2


def test_new_flags_defaults():
    args = cl.parse_args([])
    assert (args.steps_per_graph, args.rotate_l2, args.pdl) == (8, 4, "env")
    assert cl.parse_args(["--pdl", "both", "--pdl", "off"]).pdl == "off"  # the last one wins
    with pytest.raises(SystemExit):
        cl.parse_args(["--pdl", "maybe"])


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
    # FlashInfer's norm (j, k): GPU only, and only where it imports.
    run, skipped = cl.select_paths(list("dfjk"), has_gpu=False, has_liger=False)
    assert run == ["d", "f"] and "GPU only" in skipped["j"] and "GPU only" in skipped["k"]
    run, skipped = cl.select_paths(list("dfjk"), has_gpu=True, has_liger=False)
    assert run == ["d", "f"] and "FlashInfer" in skipped["j"]
    assert cl.select_paths(list("jk"), has_gpu=True, has_liger=False, has_flashinfer=True) == (
        ["j", "k"],
        {},
    )


# ---------------------------------------------------------------- CPU run


def test_cpu_run_report(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the CPU path everywhere
    rc = cl.main(
        [
            "--tokens",
            "1",
            "2",
            "--reps",
            "3",
            "--hidden-size",
            "64",
            "--no-plot",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    lines = capsys.readouterr().out.splitlines()
    assert_fits(lines)
    text = "\n".join(lines)

    # the legend, above the table
    legend_at = lines.index("Paths (key, what runs, what it measures):")
    table_at = next(i for i, line in enumerate(lines) if re.match(r"\s*T \| ", line))
    assert legend_at < table_at
    for p in "abcdefil":
        assert any(
            line.startswith(f"  {p}  {cl.PATHS[p]}") and report.PATH_MEASURES[p] in line
            for line in lines[legend_at:table_at]
        ), p
    # a reason for each requested path that is not run
    for p in "gh":
        reason = [line for line in lines if line.startswith(f"  {p}  {cl.PATHS[p]}: ")]
        assert len(reason) == 1 and len(reason[0]) > len(f"  {p}  {cl.PATHS[p]}: ") + 10
    # the spread and the warning
    assert "min / median / max over 3 reps" in text
    assert "PDL: n/a (the CPU path launches no GPU kernel)." in lines
    assert any(
        line.startswith("WARNING: CPU figures are not performance figures")
        for line in lines[:table_at]
    )
    spread = re.compile(r"\d+\.\d / +\d+\.\d / +\d+\.\d")
    for t in ("1", "2"):
        cells = [line for line in lines if re.match(rf"\s*{t} \| ", line)]
        assert cells and all(len(spread.findall(line)) >= 1 for line in cells)

    # JSON: the old keys kept, the new ones added
    result = json.loads((tmp_path / "capture_latency_cpu_H64.json").read_text())
    assert {"rows", "config", "device", "date", "command", "skipped"} <= set(result)
    assert set(result["skipped"]) == {"g", "h", "j", "k"}
    assert result["pdl"]["state"] == "n/a" and result["config"]["pdl"] == "env"
    assert result["config"]["paths"] == list("abcdefil")
    assert result["config"]["requested_paths"] == list("abcdefghijkl")
    for row in result["rows"]:
        assert set(row) == {"T", "paths"} and set(row["paths"]) == set("abcdefil")
        for d in row["paths"].values():
            assert d["min_us"] <= d["wall_us"] <= d["max_us"] and d["reps"] == 3


# ---------------------------------------------------------------- the report, from JSON

RECORDED_GPU_RUN = os.path.join(
    os.path.dirname(SCRIPT), "results", "capture_latency_gpu_H7168.json"
)


def test_report_of_the_recorded_gpu_run(capsys):
    """capture_report.py rebuilds the tables of a saved H200 run from its JSON
    alone: within 100 columns, every path keyed by the legend and heading a
    column, every cell the JSON's figure with its [% of the copy roofline]."""
    result = json.load(open(RECORDED_GPU_RUN))
    assert report.main([RECORDED_GPU_RUN]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == report.report_lines(result)
    assert_fits(lines)
    assert "one copy kernel (src + 0) moving the path's bytes" in lines[0]
    for p in result["config"]["paths"]:
        assert any(line.startswith(f"  {p}  {report.PATHS[p]}") for line in lines)
        assert any(
            re.match(r"\s*T \|", line) and re.search(rf"\| +{p}( |$)", line) for line in lines
        ), p
    for p, why in result["skipped"].items():
        assert f"  {p}  {report.PATHS[p]}: {why}" in lines
    for row in result["rows"]:
        t_lines = [line for line in lines if re.match(rf"\s*{row['T']} \| ", line)]
        for p, d in row["paths"].items():
            assert any(
                f"{d['graph_us']:.1f} [{d['graph_pct_roofline']:3.0f}%]" in line for line in t_lines
            ), (row["T"], p)


def test_report_shows_a_cost_per_floor_only_above_the_floor_minimum():
    """The capture cost as a multiple of the write floor is printed only where
    the floor is at least FLOOR_MIN_US (below, graph jitter dominates it);
    negative costs (f beating d) print with their sign."""
    result = synthetic_gpu_result("abcdefghijkl", scale=100.0, pdl_state="off")
    result["skipped"] = {}
    lines = report.format_gpu_table(result, gpu_args("abcdefghijkl"))
    assert any("j-k / f-k us" in line for line in lines)  # against FlashInfer's norm
    # every path of ours as a multiple of FlashInfer's norm alone, 3 decimals
    ratio_at = next(i for i, line in enumerate(lines) if line.startswith("Against FlashInfer"))
    head = next(line for line in lines[ratio_at:] if re.match(r"\s*T \|", line))
    assert [h.strip() for h in head.split("|")[1:]] == ["d / k", "f / k", "i / k", "l / k"]
    for row in result["rows"]:
        t_line = next(line for line in lines[ratio_at:] if re.match(rf"\s*{row['T']} \| ", line))
        assert [c.strip() for c in t_line.split("|")[1:]] == [
            f"{row['x_k'][p]:.3f}" for p in "dfil"
        ]
    assert_fits(lines)
    assert next(line for line in lines if line.startswith("PDL: ")).startswith("PDL: off (")
    for row in result["rows"]:
        t_lines = [line for line in lines if re.match(rf"\s*{row['T']} \| ", line)]
        floor = row["write_floor"]["net_us"]
        for p, cost in row["capture_cost_us"].items():
            assert any(f"{cost:+.1f}" in line for line in t_lines)
            if p in row["capture_cost_x_floor"]:
                ratio = f"{row['capture_cost_x_floor'][p]:.2f}"
                assert any(ratio in line for line in t_lines) == (floor >= report.FLOOR_MIN_US)


def test_pdl_comparison_table():
    on = synthetic_gpu_result("abcdefghi", pdl_state="on")
    off = synthetic_gpu_result("abcdefghi", scale=1.5, pdl_state="off")
    lines = report.report_lines({"pdl_on": on, "pdl_off": off})
    assert_fits(lines)
    assert lines[1].startswith("on run: PDL: on (") and lines[2].startswith("off run: PDL: off (")
    for row_on, row_off in zip(on["rows"], off["rows"]):
        t_lines = [line for line in lines if re.match(rf"\s*{row_on['T']} \| ", line)]
        for p in "abcdefghi":
            cell = re.compile(
                rf"{row_on['paths'][p]['graph_us']:.1f} / +"
                rf"{row_off['paths'][p]['graph_us']:.1f}"
            )
            assert any(cell.search(line) for line in t_lines), (row_on["T"], p)


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
    report.plot(result, gpu_args(), str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    cost_ax = fig.axes[1]
    assert cost_ax.get_yscale() == "symlog"
    marked = [tuple(xy) for c in cost_ax.collections for xy in c.get_offsets()]
    negative = [
        (r["T"], r["capture_cost_us"]["f"])
        for r in result["rows"]
        if r["capture_cost_us"]["f"] <= 0
    ]
    assert negative and all(point in marked for point in negative)
    for line in cost_ax.get_lines():  # costs drawn at their value, not clipped
        if line.get_label().startswith("f:"):
            assert min(line.get_ydata()) == pytest.approx(-0.3)
    floor = [line for line in cost_ax.get_lines() if "measured" in line.get_label()]
    assert len(floor) == 1
    assert list(floor[0].get_ydata()) == [r["write_floor"]["net_us"] for r in result["rows"]]


def test_host_timer_runs_warmup_then_chunks_and_summarises():
    from eagle_capture.testing.bench import host_us_per_call

    calls = []
    us = host_us_per_call(lambda: calls.append(1), 103, warmup=7, summary=min, sync=False)
    assert len(calls) == 7 + 5 * (103 // 5) and us > 0


# ---------------------------------------------------------------- measurement plan

L2_60MIB = 60 << 20
SET_BYTES_T1 = 3 * (3 * 7168 * 2) + 3 * 7168 * 2  # T = 1, K = 3, bf16: h, r, aux + weights


def test_rotation_defeats_l2_at_small_t():
    from eagle_capture.testing.bench import graph_steps, rotation_sets

    sets = rotation_sets(SET_BYTES_T1, L2_60MIB, 4, max_sets=cl.MAX_SETS)
    assert sets > 16 and sets * SET_BYTES_T1 >= 4 * L2_60MIB
    assert graph_steps(sets, 8) == sets  # the graph walks every set once
    big = 3 * (16384 * 3 * 7168 * 2)  # T = 16384: one set is many L2 sizes
    assert rotation_sets(big, L2_60MIB, 4, max_sets=cl.MAX_SETS) == 1
    assert graph_steps(1, 8) == 8
    assert rotation_sets(SET_BYTES_T1, L2_60MIB, 0, max_sets=cl.MAX_SETS) == 1  # warm cache
    assert rotation_sets(1, L2_60MIB, 4, max_sets=100) == 100  # the graph-size bound
    assert (
        rotation_sets(
            SET_BYTES_T1, L2_60MIB, 4, max_sets=cl.MAX_SETS, budget_bytes=10 * SET_BYTES_T1
        )
        == 10
    )  # the memory bound


def test_graph_steps_keep_outputs_within_memory():
    from eagle_capture.testing.bench import graph_steps

    kept = cl.kept_bytes("g", 16384, 7168, 3, 2)
    assert kept == 2 * 3 * 16384 * 7168 * 2
    assert graph_steps(1, 8, kept, budget_bytes=100 * kept) == 8
    assert graph_steps(1, 8, kept, budget_bytes=5 * kept + 1) == 5
    assert graph_steps(1, 8, kept, budget_bytes=0) == 1
    assert cl.kept_bytes("e", 16384, 7168, 3, 2) == 0  # in place: nothing kept


class _TorchOnCpu:
    """run_gpu's view of torch with "cuda" mapped to the CPU and a small L2."""

    def __init__(self, l2_bytes):
        from types import SimpleNamespace

        self.cuda = SimpleNamespace(
            get_device_properties=lambda device: SimpleNamespace(L2_cache_size=l2_bytes),
            empty_cache=lambda: None,
        )

    def device(self, *args):
        return torch.device("cpu")

    def __getattr__(self, name):
        return getattr(torch, name)


def test_gpu_sweep_plan_with_fake_timers(monkeypatch):
    """run_gpu's bookkeeping without a GPU: CPU tensors, timers replaced by a
    stand-in that runs the graph's first step and records the plan."""
    import eagle_capture.testing.bench as bench

    l2 = 64 << 10
    graphs = []

    def fake_graph(steps, steps_per_graph, replays):
        graphs.append((len(steps), steps_per_graph))
        out = steps[0]()
        return 1.0 + (out.numel() * 1e-3 if isinstance(out, torch.Tensor) else 0.0)

    monkeypatch.setattr(cl, "torch", _TorchOnCpu(l2))
    monkeypatch.setattr(cl, "time_graph_replay", fake_graph)
    monkeypatch.setattr(bench, "time_graph_replay", fake_graph)
    monkeypatch.setattr(cl, "time_events", lambda steps, reps: 50.0)
    monkeypatch.setattr(cl, "free_bytes", lambda device: 1 << 30)
    monkeypatch.setattr(
        cl, "measure_copy_roofline", lambda device: {"bytes": 4 << 30, "us": 1e3, "gbps": 4000.0}
    )
    monkeypatch.setattr(cl, "measure_host_overhead", lambda *a: {"torch.add(out=)": 9.0})
    args = cl.parse_args(
        ["--paths", "abcdefi", "--hidden-size", "64", "--tokens", "1", "64", "1024"]
    )
    result = cl.run_gpu(args)
    elem = 2
    for row in result["rows"]:
        set_bytes = 3 * row["T"] * 3 * 64 * elem + 3 * 64 * elem
        assert row["input_sets"] * set_bytes >= 4 * l2 or row["input_sets"] == cl.MAX_SETS
        assert row["input_l2_multiple"] >= 4
        for d in row["paths"].values():
            assert (
                d["steps_per_graph"] >= max(8, d["input_sets"])
                and d["input_sets"] == row["input_sets"]
            )
            copy = d["copy"]
            assert d["bytes"] - 2 * elem < copy["bytes"] <= d["bytes"]
            assert copy["steps_per_graph"] >= d["steps_per_graph"]
            assert copy["pairs"] * d["bytes"] >= 4 * l2 or copy["pairs"] == cl.MAX_SETS
            assert d["graph_pct_roofline"] == pytest.approx(100 * d["graph_gbps"] / copy["gbps"])
        floor = row["write_floor"]
        assert floor["bytes"] == row["T"] * 3 * 64 * elem
        assert floor["net_us"] == pytest.approx(floor["us"] - floor["fixed_us"])
        assert floor["buffers"] * floor["bytes"] >= 4 * l2 or floor["buffers"] == cl.MAX_SETS
        assert set(row["capture_cost_x_floor"]) == {"b", "e", "f"}
    assert row["input_sets"] == 1 or row["T"] < 1024
    assert result["rows"][0]["input_sets"] > 16  # T = 1
    assert all(steps_per_graph >= 8 for _, steps_per_graph in graphs)
    result.update(skipped={}, pdl=cl.pdl_report(has_gpu=False))
    assert_fits(report.format_gpu_table(result, args))


# ---------------------------------------------------------------- PDL runs


def test_pdl_from_env_matches_the_ops():
    assert cl.pdl_from_env({}) == "on"
    assert cl.pdl_from_env({"EAGLE_CAPTURE_PDL": "1"}) == "on"
    assert cl.pdl_from_env({"EAGLE_CAPTURE_PDL": "0"}) == "off"


@pytest.mark.parametrize(
    "env, flag, rerun",
    [
        (None, "off", "0"),
        ("0", "on", "1"),
        ("0", "off", None),
        (None, "on", None),
        ("0", "env", None),
    ],
)
def test_pdl_flag_reruns_only_when_the_setting_differs(env, flag, rerun, monkeypatch, tmp_path):
    if env is None:
        monkeypatch.delenv("EAGLE_CAPTURE_PDL", raising=False)
    else:
        monkeypatch.setenv("EAGLE_CAPTURE_PDL", env)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    calls = []

    class Done:
        returncode = 0

    monkeypatch.setattr(cl.subprocess, "run", lambda cmd, env: calls.append((cmd, env)) or Done)
    argv = [
        "--tokens",
        "1",
        "--reps",
        "2",
        "--hidden-size",
        "64",
        "--paths",
        "a",
        "--no-plot",
        "--pdl",
        flag,
        "--out",
        str(tmp_path),
    ]
    assert cl.main(argv) == 0
    if rerun is None:
        assert not calls
        written = list(tmp_path.iterdir())
        assert len(written) == 1 and written[0].name.endswith(
            "_H64.json" if flag == "env" else f"_H64_pdl-{flag}.json"
        )
    else:
        ((cmd, child_env),) = calls
        assert cmd[-2:] == ["--pdl", flag] and cmd[2:-2] == argv
        assert child_env["EAGLE_CAPTURE_PDL"] == rerun
        assert not list(tmp_path.iterdir())


def test_pdl_both_runs_two_children_and_compares(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the children run the CPU path too
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = cl.main(
        [
            "--tokens",
            "1",
            "2",
            "--reps",
            "2",
            "--hidden-size",
            "64",
            "--paths",
            "ad",
            "--no-plot",
            "--pdl",
            "both",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    lines = capfd.readouterr().out.splitlines()
    assert_fits([line for line in lines if not line.startswith("wrote ")])  # tmp_path is long
    assert any(line.startswith("PDL on vs off: two runs") for line in lines)
    both = json.loads((tmp_path / "capture_latency_cpu_H64_pdl-both.json").read_text())
    assert both["pdl_on"]["pdl"]["env"] == "1" and both["pdl_off"]["pdl"]["env"] == "0"
    assert both["pdl_on"]["config"]["pdl"] == "on" and both["pdl_off"]["config"]["pdl"] == "off"
    for t in ("1", "2"):
        assert any(re.match(rf"\s*{t} \| .* / .*\| .* / ", line) for line in lines), t
