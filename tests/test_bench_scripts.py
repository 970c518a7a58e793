"""The tuning script (benchmarks/tune_kernel.py), the host-time breakdown of
benchmarks/capture_latency.py and the skip check of tools/gpu/gpu_session.sh,
without a GPU: command lines, the kernel launches of every tuning variant
under Triton's interpreter, the sweep's bookkeeping with a stand-in timer, and
the skip check on canned pytest logs."""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import INTERPRETED

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir))
BENCH = os.path.join(ROOT, "benchmarks")
SESSION = os.path.join(ROOT, "tools", "gpu", "gpu_session.sh")
MAX_COLUMNS = 100


def _load(name):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


tk = _load("tune_kernel")
cl = _load("capture_latency")
dl = _load("draft_layout")


def run_script(*args, env=None):
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env
    )


# ---------------------------------------------------------------- tune_kernel: command line


def test_tune_kernel_help():
    result = run_script("benchmarks/tune_kernel.py", "--help")
    assert result.returncode == 0
    for flag in ("--sweep", "--only", "--list", "--rotate-l2", "evict_first"):
        assert flag in result.stdout


def test_tune_kernel_without_gpu_says_so_and_exits_0(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert tk.main([]) == 0
    assert "no CUDA GPU here, nothing measured" in capsys.readouterr().out


@pytest.mark.parametrize("sweep", ["launch", "variants"])
def test_tune_kernel_list(sweep):
    result = run_script("benchmarks/tune_kernel.py", "--sweep", sweep, "--list")
    assert result.returncode == 0, result.stderr
    names = [v.name for v in tk.SWEEPS[sweep][0](7168)]
    for name in names:
        assert any(line.startswith(f"  {name} ") for line in result.stdout.splitlines()), name


def test_launch_sweep_keeps_the_old_grid():
    """What the old tune_kernel.py swept: d and e (norm, +capture) at one program
    per row x 4 warp counts; c in column blocks 1024 - 8192 x 2 - 16 warps."""
    variants = tk.launch_sweep(7168)
    shapes = {(v.kind, *v.launch_shape(7168)[:2]) for v in variants}
    assert {("d", 8192, nw) for nw in (4, 8, 16, 32)} <= shapes
    assert {("e", 8192, nw) for nw in (4, 8, 16, 32)} <= shapes
    capture = {(b, nw) for k, b, nw in shapes if k == "c"}
    assert capture == {
        (b, nw)
        for b in (1024, 2048, 4096, 8192)
        for nw in (2, 4, 8, 16)
        if b // (nw * 32) >= 8 or b >= 8192
    }
    assert len(variants) == len(shapes) == 21
    assert not any(v.pdl or v.out_of_place for v in variants)


def test_variants_sweep_covers_what_the_kernel_can_vary():
    variants = tk.variants_sweep(7168)
    names = [v.name for v in variants]
    assert len(set(names)) == len(names)
    for kind in tk.KINDS:  # every kind at the shipped configuration, PDL off and on
        assert kind in names and f"{kind} pdl" in names
    shipped = {
        v.name: v.launch_shape(7168) for v in variants if v.block_h is None and v.num_warps is None
    }
    from eagle_capture.kernels import launch_config

    for name, shape in shipped.items():
        assert shape == launch_config(7168, tk.KINDS[name[0]].apply_norm)
    assert any(v.out_of_place for v in variants)


def test_tune_kernel_only_and_bad_names(capsys):
    args = tk.parse_args(["--sweep", "variants", "--only", "d pdl", "c"])
    assert [v.name for v in args.variants] == ["c", "d pdl"] and args.launches == 3
    with pytest.raises(SystemExit) as exc:
        tk.parse_args(["--only", "c ship"])
    assert exc.value.code == 2
    assert "no variant 'c ship' in the launch sweep" in capsys.readouterr().err


def test_norm_variant_needs_the_whole_row():
    with pytest.raises(ValueError, match="whole row"):
        tk.Variant("d b4096", "d", block_h=4096).launch_shape(7168)
    assert tk.Variant("c b4096", "c", block_h=4096).launch_shape(7168) == (4096, 4, 2)


def test_kinds_match_the_ops_bytes():
    assert {k: kind.rows_moved for k, kind in tk.KINDS.items()} == {
        "c": 3,
        "d": 4,
        "e": 5,
        "f": 4,
        "i": 5,
        "l": 4,
    }
    assert (
        tk.PEER_KIND.rows_moved == 4
        and cl.bytes_moved("k", 4, 7168, 1, 2) == 4 * 4 * 7168 * 2 + 7168 * 2
    )
    for k, kind in tk.KINDS.items():  # capture_latency.bytes_moved, weight included
        weight = 7168 * 2 * kind.apply_norm
        assert cl.bytes_moved(k, 4, 7168, 1, 2) == kind.rows_moved * 4 * 7168 * 2 + weight


# ---------------------------------------------------------------- tune_kernel: launches

needs_interpreter = pytest.mark.skipif(not INTERPRETED, reason="needs Triton's interpreter")


@needs_interpreter
@pytest.mark.parametrize("sweep", ["launch", "variants"])
def test_every_variant_launches_the_production_kernel_correctly(sweep):
    """Each variant's launch, checked by the script's own check (fp16: the
    interpreter's fp16 casts round like the GPU's; its bf16 cast truncates). The
    kernel it launches is the one the package ships, so a tuned launch shape
    applies to the ops as they are."""
    from eagle_capture import kernels

    assert tk.add_rmsnorm_capture_kernel is kernels.add_rmsnorm_capture_kernel
    torch.manual_seed(0)
    for v in tk.SWEEPS[sweep][0](7168):
        if v.pdl:
            continue  # the interpreter has no PDL
        inputs = tk.make_set(3, 7168, torch.float16, "cpu", v.out_of_place)
        tk.check_variant(v, v.launch_shape(7168), inputs)


@needs_interpreter
def test_flashinfer_sweep_variants_launch_correctly():
    """The flashinfer sweep's own variants (cache hints, the late trigger, warps)
    with PDL off, checked as the sweep checks them; FlashInfer's norm (the peer) is
    not ours to run here."""
    import dataclasses

    torch.manual_seed(0)
    variants = [v for v in tk.flashinfer_sweep(256) if v.kind != tk.PEER]
    assert {"l aux.cs", "l aux.el", "l late", "l w*2", "l slot-major", "l padded"} <= {
        v.name for v in variants
    }
    for v in variants:
        v = dataclasses.replace(v, pdl=False)
        inputs = tk.make_set(5, 256, torch.float16, "cpu", v.out_of_place)
        tk.check_variant(v, v.launch_shape(256), inputs)


def test_warps_at_takes_the_ops_bands_unless_a_variant_sets_its_own():
    """The sweeps launch (and record) the warps the op takes: launch_config's for H,
    one_wave_warps' in its bands of T on a device that has them; a variant's own
    warps or block always."""
    by_name = {v.name: v for v in tk.flashinfer_sweep(7168)}
    shipped, h_only, doubled = by_name["l pdl"], by_name["l h-only"], by_name["l w*2"]
    assert [tk.warps_at(shipped, 7168, t, 132) for t in (100, 232, 300)] == [16, 32, 16]
    assert tk.warps_at(shipped, 7168, 232, None) == 16  # no bands on this device
    assert tk.warps_at(h_only, 7168, 232, 132) == 16
    assert tk.warps_at(doubled, 7168, 100, 132) == 32
    assert tk.warps_at(tk.flashinfer_sweep(2880)[2], 2880, 600, 132) == 8


@needs_interpreter
def test_a_sweep_launch_takes_warps_at(monkeypatch):
    """launch() asks warps_at for its warps, with no bands on a CPU tensor."""
    asked = []

    def spy(v, hidden_size, tokens, sms):
        asked.append((v.name, hidden_size, tokens, sms))
        return tk.launch_config(hidden_size, True)[1]

    monkeypatch.setattr(tk, "warps_at", spy)
    v = next(v for v in tk.flashinfer_sweep(256) if v.name == "l")
    tk.check_variant(v, v.launch_shape(256), tk.make_set(5, 256, torch.float16, "cpu", False))
    assert asked == [("l", 256, 5, None)]


@pytest.mark.parametrize(
    "layout, row_stride, slot_offsets",
    [
        ("interleaved", 3 * 8, [0, 8, 16]),  # the draft's [T, 3H]
        ("slot-major", 8, [0, 5 * 8, 2 * 5 * 8]),  # each slot's rows contiguous
        ("padded", 3 * 8 + 64, [0, 8, 16]),  # rows 3H + AUX_PAD apart
    ],
)
def test_aux_layouts_place_a_slot_in_the_storage(layout, row_stride, slot_offsets):
    """Each layout's view of the aux storage: the row stride and where each slot's
    first element lies, inside the storage a set allocates."""
    v = tk.Variant("l", "l", aux_layout=layout)
    inputs = tk.make_set(5, 8, torch.float32, "cpu", False)
    base = inputs.aux.data_ptr()
    for slot, offset in enumerate(slot_offsets):
        view, index = tk.slot_view(v, inputs.aux, 8, slot)
        rows = view[:, index]
        assert rows.shape == (5, 8) and rows.stride() == (row_stride, 1)
        assert (rows.data_ptr() - base) // 4 == offset
        last = rows[-1, -1].data_ptr() - base
        assert last < inputs.aux.numel() * 4
    with pytest.raises(ValueError, match="no aux layout"):
        tk.slot_view(tk.Variant("x", "l", aux_layout="diagonal"), inputs.aux, 8, 0)


@needs_interpreter
def test_check_catches_a_wrong_launch(monkeypatch):
    v = tk.Variant("e", "e")
    inputs = tk.make_set(2, 256, torch.float16, "cpu", False)
    real = tk.launch
    monkeypatch.setattr(tk, "launch", lambda v, shape, i, aux, slot: real(v, shape, i, aux, 1))
    with pytest.raises(AssertionError, match="capture differs"):
        tk.check_variant(v, v.launch_shape(256), inputs)
    monkeypatch.setattr(
        tk, "launch", lambda v, shape, i, aux, slot: real(tk.Variant("f", "f"), shape, i, aux, slot)
    )
    with pytest.raises(AssertionError, match="residual differs"):
        tk.check_variant(v, v.launch_shape(256), inputs)


def test_steps_rotate_inputs_and_slots(monkeypatch):
    calls = []
    monkeypatch.setattr(
        tk, "launch", lambda v, shape, inputs, aux, slot: calls.append((inputs, aux, slot))
    )
    sets = [SimpleNamespace(aux=f"aux{i}") for i in range(5)]
    steps = tk.graph_steps_of(tk.Variant("c", "c"), None, sets, 3)
    assert len(steps) == 5
    steps[4]()
    assert calls == [(sets[2], "aux4", 0), (sets[3], "aux4", 1), (sets[4], "aux4", 2)]
    # a graph's steps walk the sets in order, launch after launch: a set's rows come
    # back only after all the others' (no launch finds its inputs in L2)
    calls.clear()
    for step in steps:
        step()
    order = [sets.index(inputs) for inputs, _, _ in calls]
    assert order == [i % 5 for i in range(15)]


class _CudaOnCpu:
    """tune_kernel's view of torch with "cuda" mapped to the CPU and a small L2."""

    def __init__(self, l2_bytes):
        self.cuda = SimpleNamespace(
            get_device_properties=lambda device: SimpleNamespace(L2_cache_size=l2_bytes),
            mem_get_info=lambda device: (1 << 30, 1 << 31),
            empty_cache=lambda: None,
        )

    def device(self, *args):
        return torch.device("cpu")

    def __getattr__(self, name):
        return getattr(torch, name)


class _SplitNorm(tk.Variant):
    """A wrong launch: the norm's row split over two programs (parse_args refuses it)."""

    def launch_shape(self, hidden_size):
        return hidden_size // 2, 4, 2


@needs_interpreter
def test_sweep_with_a_stand_in_timer(monkeypatch, capsys):
    """run()'s bookkeeping: rotated sets, the check, one timing per cell, a row per
    T; a variant with wrong outputs gets a WRONG cell and the reason on stderr."""
    timed = []

    def fake_timer(steps, steps_per_graph, replays):
        steps[0]()  # the launches of one step, under the interpreter
        timed.append((len(steps), steps_per_graph, replays))
        return 10.0

    monkeypatch.setattr(tk, "torch", _CudaOnCpu(64 << 10))
    monkeypatch.setattr(tk, "time_graph_replay", fake_timer)
    monkeypatch.setattr(tk, "measure_copy_roofline", lambda device: {"gbps": 1000.0})
    args = tk.parse_args(
        [
            "--sweep",
            "variants",
            "--dtype",
            "fp16",
            "--hidden-size",
            "256",
            "--tokens",
            "1",
            "4",
            "--only",
            "c",
            "d oop",
            "f",
        ]
    )
    tk.run(args, args.variants + [_SplitNorm("broken", "d")], args.launches)
    out, err = capsys.readouterr()
    header = next(line for line in out.splitlines() if line.split()[:2] == ["T", "sets"])
    assert header.split()[2:] == ["c", "f", "d", "oop", "broken"]  # the sweep's order
    rows = [line for line in out.splitlines() if re.match(r" +[14] +[0-9]+ +[0-9.]+ \(", line)]
    assert len(rows) == 2
    sets = {}
    for line in rows:
        T, num_sets = map(int, line.split()[:2])
        sets[T] = num_sets
        assert line.count("10.00 (") == 3 and line.rstrip().endswith(" WRONG")
        # every set once per graph; >= 4 x the 64 KiB "L2", >= one set per launch of a step
        assert num_sets * tk.set_bytes(T, 256, 2, True) >= 4 * (64 << 10) and num_sets >= 3
    assert err.count("broken: AssertionError: broken: normed output rel err") == 2
    assert timed == [(sets[1], 8, 30)] * 3 + [(sets[4], 8, 30)] * 3


# ---------------------------------------------------------------- draft_layout


def test_draft_layout_help_and_without_gpu(capsys, monkeypatch):
    result = run_script("benchmarks/draft_layout.py", "--help")
    assert result.returncode == 0 and "slot-major" in result.stdout
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dl.main([]) == 0
    assert "no CUDA GPU here, nothing measured" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv", [["--tokens", "0"], ["--hidden-size", "0"], ["--dtype", "x"], ["--rounds", "0"]]
)
def test_draft_layout_refuses_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        dl.parse_args(argv)
    assert exc.value.code == 2


@needs_interpreter
def test_draft_layout_fc_reads_the_rows_the_capture_wrote():
    """In each layout the draft's fc reads the slots where the capture's launches
    put them: slot k of token t is h_k[t] + r_k[t], and both layouts' fc equal
    the [T, 3H] GEMM of those rows (fp32: the three-GEMM sum to rounding)."""
    import dataclasses

    torch.manual_seed(0)
    T, H = 5, 64
    inputs = [tk.make_set(T, H, torch.float32, "cpu", False) for _ in range(tk.SLOTS)]
    weight = torch.randn(H, tk.SLOTS * H)
    want_rows = torch.cat([i.h + i.r for i in inputs], dim=1)  # [T, 3H] before any launch
    want = want_rows @ weight.t()
    for layout, v in dl.LAYOUTS.items():
        v = dataclasses.replace(v, pdl=False)  # the interpreter has no PDL
        aux = torch.full_like(inputs[0].aux, float("nan"))
        for k, one in enumerate(inputs):
            tk.launch(v, v.launch_shape(H), one.clone(), aux, k)
        rows = dl.slots_of(layout, aux, H)
        got_rows = rows if layout == "interleaved" else rows.transpose(0, 1).reshape(T, -1)
        assert torch.equal(got_rows, want_rows), layout
        out = torch.full((T, H), float("nan"))
        dl.draft_fc(layout, rows, weight, out)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)


def test_draft_layout_check_catches_a_wrong_fc(monkeypatch):
    weight = (torch.randn(32, 3 * 32) * 0.1).to(torch.bfloat16)
    one = tk.make_set(4, 32, torch.bfloat16, "cpu", False)
    assert dl.check_fc(weight, one, 32) < 1e-2  # bf16 rounding only
    real = dl.draft_fc

    def drops_a_slot(layout, x, w, out):
        real(layout, x, w, out)
        if layout == "slot-major":
            out.sub_(x[2] @ w[:, 64:].t())

    monkeypatch.setattr(dl, "draft_fc", drops_a_slot)
    with pytest.raises(AssertionError, match="fc differ"):
        dl.check_fc(weight, one, 32)


@needs_interpreter
def test_draft_layout_rounds_alternate_the_layouts(monkeypatch):
    """measure() times every cell in both layouts each round, the order reversed
    each round: a timer that drifts up with every timing (a GEMM-bound step on a
    warming GPU) favours neither layout."""
    import dataclasses

    calls = []

    def drifting_timer(steps, steps_per_graph, replays):
        steps[0]()  # one step's launches and GEMM, under the interpreter
        calls.append(len(steps))
        return float(len(calls))

    monkeypatch.setattr(dl, "torch", _CudaOnCpu(64 << 10))
    monkeypatch.setattr(tk, "torch", _CudaOnCpu(64 << 10))
    monkeypatch.setattr(dl, "time_graph_replay", drifting_timer)
    no_pdl = {k: dataclasses.replace(v, pdl=False) for k, v in dl.LAYOUTS.items()}
    monkeypatch.setattr(dl, "LAYOUTS", no_pdl)
    args = dl.parse_args(["--dtype", "fp16", "--rounds", "2"])
    cells = dl.measure(args, 64, 3)
    assert len(calls) == 2 * len(dl.LAYOUTS) * len(dl.WHAT)
    for what in dl.WHAT:
        assert cells[what]["interleaved"] == cells[what]["slot-major"], what


# ---------------------------------------------------------------- capture_latency --host-breakdown


def test_host_breakdown_flag(tmp_path):
    """Without a GPU it says so and writes nothing; on a GPU it prints the table
    and writes its JSON (the GPU run of the suite checks the second branch)."""
    result = run_script("benchmarks/capture_latency.py", "--host-breakdown", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    if not torch.cuda.is_available():
        assert "No GPU: --host-breakdown" in result.stdout and "nothing measured" in result.stdout
        assert not list(tmp_path.iterdir())
    else:
        assert "Host time per eager call, T = 1" in result.stdout
        assert "DirectLaunch, int pointers" in result.stdout
        assert [p.name for p in tmp_path.iterdir()] == ["capture_latency_gpu_H7168_host.json"]


def test_host_breakdown_refuses_pdl_both(capsys):
    with pytest.raises(SystemExit) as exc:
        cl.parse_args(["--host-breakdown", "--pdl", "both"])
    assert exc.value.code == 2
    assert cl.parse_args(["--host-breakdown"]).host_breakdown


def test_host_table_and_breakdown_share_one_timer(monkeypatch):
    """The report's table and --host-breakdown time the same calls the same way."""
    seen = []
    monkeypatch.setattr(
        cl,
        "host_us_per_call",
        lambda fn, n, **kw: (
            seen.append((n, kw["warmup"], kw["summary"])) or kw["summary"]([1.0, 2.0, 3.0])
        ),
    )
    table = cl.measure_host_overhead(64, torch.float32, torch.device("cpu"), 10)
    assert list(table) == list(cl.host_calls(64, torch.float32, torch.device("cpu"))[0])
    assert set(table.values()) == {2.0}
    assert cl.time_host_calls({"x": lambda: None}, torch.device("cpu"), 10, summary=list) == {
        "x": [1.0, 2.0, 3.0]
    }
    assert {(n, warmup) for n, warmup, _ in seen} == {(10, 50)}


def test_host_calls_run_on_cpu():
    calls, facts = cl.host_calls(64, torch.float32, torch.device("cpu"))
    assert facts == {}
    for fn in calls.values():
        fn()


@needs_interpreter
def test_launch_layers_wiring_under_the_interpreter(monkeypatch):
    """The layers under add_capture, launching the op's own kernel arguments
    (the eager path's plan), each called once: CPU tensors, Triton's
    interpreter. The compiled-launcher and DirectLaunch rows need a GPU (the
    interpreter compiles nothing) and are absent here."""
    from eagle_capture.kernels import add_rmsnorm_capture_kernel as kernel

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 0, raising=False)
    x = cl.make_inputs(3, 64, 2, torch.float32, torch.device("cpu"))
    h, r, aux = x.hidden[0], x.residual[0], x.aux
    tensors, plan = cl.eager_plan(h, r, aux)
    bound = dict(zip(kernel.arg_names, (*plan.head(tensors), *plan.tail_entry)))
    assert plan.grid == (3, 1) and plan.use_pdl is False
    assert bound["CAPTURE"] and not bound["APPLY_NORM"] and bound["USE_PDL"] is False
    assert bound["aux_ptr"] is aux and bound["hidden_ptr"] is h
    calls, facts = cl.launch_layers(h, r, aux)
    assert {
        "kernel[grid](...) (Triton's entry)",
        "FastLaunch.launch",
        "6x tensor.data_ptr()",
        "torch.cuda.current_device()",
    } <= set(calls)
    assert {"direct launch supported", "launch hooks active (a profiler)", "PDL"} <= set(facts)
    for name, fn in calls.items():
        if name == "torch.cuda.current_device()":
            continue
        aux.fill_(float("nan"))
        fn()
        if "kernel" in name or "Launch" in name:
            assert torch.equal(aux[:, 0], h + r), name  # the op's launch: h + r into slot 0
            assert torch.isnan(aux[:, 1]).all(), name


def test_host_breakdown_report_and_json(monkeypatch, capsys, tmp_path):
    """--host-breakdown's flow with stand-ins for the GPU: the table (median and
    best chunk per call), the facts, the profile, and the JSON."""
    calls = {
        "torch.add(out=)": lambda: None,
        "add_capture (public, eager fast path)": lambda: None,
        "key of 3 tensors (shape, stride, dtype, get_device)": lambda: None,
    }
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(cl, "host_calls", lambda *a, **k: (calls, {"PDL": True}))
    monkeypatch.setattr(
        cl, "device_identity", lambda: {"device": "GPU", "torch": "t", "triton": "3"}
    )
    monkeypatch.setattr(cl, "pdl_report", lambda has_gpu: {"state": "on"})
    monkeypatch.setattr(cl, "liger_fused_add_rmsnorm", lambda: None)
    assert cl.main(["--host-breakdown", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = [line for line in lines if any(line.startswith(f"  {name}") for name in calls)]
    assert len(table) == 3 and all(len(line) <= MAX_COLUMNS for line in table)
    assert "  PDL: True" in lines and any("cProfile of 2000" in line for line in lines)
    result = json.loads((tmp_path / "capture_latency_gpu_H7168_host.json").read_text())
    for name in calls:
        d = result["host_us_per_call"][name]
        assert len(d["chunks_us"]) == 5 and d["best_us"] == min(d["chunks_us"])
    assert result["config"]["host_breakdown"] and "rows" not in result


# ---------------------------------------------------------------- gpu_session.sh


def test_gpu_session_syntax():
    assert subprocess.run(["bash", "-n", SESSION]).returncode == 0


def check_skips(tmp_path, log_text, gpus):
    log = tmp_path / "tests.log"
    log.write_text(log_text)
    return subprocess.run(
        ["bash", SESSION, "--check-skips", str(log), str(gpus)],
        capture_output=True,
        text=True,
        timeout=60,
    )


EXPECTED_LOG = """\
........s.....s......ss.......................................  [100%]
=========================== short test summary info ============================
SKIPPED [1] tests/test_torch_integration.py:205: needs two GPUs
SKIPPED [2] tests/test_bad_inputs.py:219: self-overlap is a property of the strides alone
SKIPPED [54] tests/test_sglang_real.py:60: EAGLE_CAPTURE_SKIP_SGLANG_REAL=1 (no PyPI here)
SKIPPED [3] tests/test_ops.py:249: needs Triton's interpreter
SKIPPED [1] tests/test_setup_env.py:44: python3 already has torch and triton: the script uses it
SKIPPED [1] tests/test_tp_gpu.py:96: needs 2 GPUs (one per rank; torch's symmetric memory \
refuses two ranks on one GPU)
SKIPPED [1] tests/test_symm.py:375: needs 2 GPUs
2504 passed, 63 skipped, 1 xfailed, 14 warnings in 209.33s (0:03:29)
tests rc=0
"""


def test_skip_check_passes_the_expected_reasons(tmp_path):
    result = check_skips(tmp_path, EXPECTED_LOG, 1)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all 63 expected" in result.stdout


def test_skip_check_counts_gpus(tmp_path):
    result = check_skips(tmp_path, EXPECTED_LOG, 2)  # "needs two GPUs" on a 2-GPU machine
    assert result.returncode == 1
    named = [line for line in result.stdout.splitlines() if line.startswith("  SKIPPED")]
    assert len(named) == 3 and all("GPUs" in line for line in named)
    assert check_skips(tmp_path, EXPECTED_LOG, 8).returncode == 1


@pytest.mark.parametrize(
    "reason",
    [
        "needs a CUDA GPU",
        "needs a GPU",
        "this Triton has no direct-launch support; every launch is Triton's own",
        "no GPU and TRITON_INTERPRET is not set",
        "the +cpu pin applies to Linux x86_64",
        "needs 1 GPUs",
    ],
)
def test_skip_check_fails_and_names_an_unexpected_reason(tmp_path, reason):
    log = EXPECTED_LOG.replace("63 skipped", "65 skipped").replace(
        "2504 passed", f"SKIPPED [2] tests/test_x.py:7: {reason}\n2504 passed"
    )
    result = check_skips(tmp_path, log, 1)
    assert result.returncode == 1
    assert "tests FAILED: skipped for a reason not expected" in result.stdout
    named = [line for line in result.stdout.splitlines() if line.startswith("  SKIPPED")]
    assert named == [f"  SKIPPED [2] tests/test_x.py:7: {reason}"]


def test_skip_check_without_reasons_fails(tmp_path):
    """pytest run without -rs: skips counted but no reasons to check."""
    result = check_skips(tmp_path, "...s..\n5 passed, 1 skipped in 1.00s\n", 1)
    assert result.returncode == 1 and "run pytest with -rs" in result.stdout


@pytest.mark.parametrize(
    "log", ["", "...\n3 passed in 0.50s\ntests rc=0\n", "=== 3 passed, 1 deselected in 0.50s ===\n"]
)
def test_skip_check_with_no_skips_passes(tmp_path, log):
    assert check_skips(tmp_path, log, 1).returncode == 0


def test_skip_check_reads_colour_and_unfolded_lines(tmp_path):
    log = (
        "\x1b[33mSKIPPED\x1b[0m [1] tests/test_a.py:3: needs a CUDA GPU\n"
        "SKIPPED tests/test_b.py::test_x[bf16] - needs Triton's interpreter\n"
        "SKIPPED tests/test_b.py::test_y - needs a GPU\r\n"
        "\x1b[32m5 passed\x1b[0m, \x1b[33m3 skipped\x1b[0m in 1.00s\n"
    )
    result = check_skips(tmp_path, log, 1)
    assert result.returncode == 1
    named = [line.strip() for line in result.stdout.splitlines() if line.startswith("  SKIPPED")]
    assert named == [
        "SKIPPED [1] tests/test_a.py:3: needs a CUDA GPU",
        "SKIPPED tests/test_b.py::test_y - needs a GPU",
    ]


def test_skip_check_on_the_recorded_gpu_logs(tmp_path):
    for name, gpus_ok, gpus_bad in [
        ("gpu_tests_2026-11-30.txt", 1, 2),
        ("symm_gpu_tests.txt", 1, 2),
    ]:
        path = os.path.join(BENCH, "results", name)
        ok = subprocess.run(
            ["bash", SESSION, "--check-skips", path, str(gpus_ok)], capture_output=True, text=True
        )
        bad = subprocess.run(
            ["bash", SESSION, "--check-skips", path, str(gpus_bad)], capture_output=True, text=True
        )
        assert (ok.returncode, bad.returncode) == (0, 1), (name, ok.stdout, bad.stdout)


def test_skip_check_usage_errors(tmp_path):
    for args in ([], ["log", "two"], ["a", "1", "x"]):
        result = subprocess.run(
            ["bash", SESSION, "--check-skips", *args], capture_output=True, text=True
        )
        assert result.returncode == 2 and "usage" in result.stderr
    missing = subprocess.run(
        ["bash", SESSION, "--check-skips", str(tmp_path / "none"), "1"],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 1 and "cannot read" in missing.stdout


# ---------------------------------------------------------------- gpu_session.sh, whole session


def _write(path, text, mode=0o755):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


@pytest.fixture
def session(tmp_path):
    """gpu_session.sh in a stand-in checkout: scripts/test.sh prints a canned
    pytest log, bench.sh records its arguments, setup_env.sh names a stand-in
    python that reports FAKE_GPUS GPUs, and nvidia-smi is on PATH."""
    repo = tmp_path / "repo"
    _write(repo / "tools" / "gpu" / "gpu_session.sh", open(SESSION).read())
    _write(
        repo / "scripts" / "test.sh",
        'echo "test.sh $*" > "$OUT/test_args"\n'
        'echo "${OMP_NUM_THREADS:-unset}" > "$OUT/test_threads"\n'
        # pytest's answer to SIGINT: its summary, then exit status 2
        # pytest done (its summary and record written), then slow to exit
        'if [ -n "${FAKE_SLOW_EXIT:-}" ]; then\n'
        '    echo "=== 4 passed in 1.00s ==="\n'
        '    printf \'{\\n "exit_status": %s,\\n "files": {}\\n}\\n\' "$FAKE_SLOW_EXIT"'
        ' > "$OUT/test_record.json"\n'
        "    trap 'exit 2' INT; sleep 30 & wait; exit 0\n"
        "fi\n"
        'if [ -n "${FAKE_TEST_SLEEP:-}" ]; then\n'
        "    trap 'echo \"=== 3 passed, 1 skipped (interrupted) ===\"; exit 2' INT\n"
        '    sleep "$FAKE_TEST_SLEEP" & wait; exit 0\n'
        "fi\n"
        # the sglang step's own pytest: its log, and the path it ran with
        'case "$*" in *test_probe_sglang_gpu*) echo "$PYTHONPATH" > "$OUT/sglang_path"\n'
        '    cat "$FAKE_SGLANG_LOG"; exit "${FAKE_SGLANG_RC:-0}" ;; esac\n'
        'cat "$FAKE_TEST_LOG"; exit "$FAKE_TEST_RC"\n',
    )
    _write(
        repo / "scripts" / "bench.sh",
        'echo "bench.sh $*"; echo "${OMP_NUM_THREADS:-unset}" > "$OUT/bench_threads"\n'
        'case "$*" in *--host-breakdown*) printf "table\\ncProfile of\\nprofile line\\n"\n'
        '                                 exit "$FAKE_HOST_RC" ;; esac\n'
        'exit "$FAKE_BENCH_RC"\n',
    )
    _write(repo / "scripts" / "setup_env.sh", f"echo {tmp_path / 'bin' / 'python'}\n")
    _write(
        tmp_path / "bin" / "python",
        '#!/bin/sh\ncase "$*" in *device_count*) echo "$FAKE_GPUS" ;; *) echo "torch triton" ;;'
        " esac\n",
    )
    _write(tmp_path / "bin" / "nvidia-smi", "#!/bin/sh\necho GPU 0: H200\n")
    _write(tmp_path / "bin" / "nproc", "#!/bin/sh\necho 16\n")  # a GPU machine's CPUs
    log = tmp_path / "pytest.log"
    log.write_text(EXPECTED_LOG)

    def run(*args, gpus=1, test_rc=0, bench_rc=0, host_rc=0, log_text=None, env_extra=()):
        if log_text is not None:
            log.write_text(log_text)
        out = tmp_path / "out"
        env = dict(
            os.environ,
            PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}",
            OUT=str(out),
            FAKE_TEST_LOG=str(log),
            FAKE_TEST_RC=str(test_rc),
            FAKE_GPUS=str(gpus),
            FAKE_BENCH_RC=str(bench_rc),
            FAKE_HOST_RC=str(host_rc),
        )
        # The session's own settings, as a GPU run of this suite exports them (STEPS=tests
        # there made every stand-in skip its bench, host and sglang steps).
        for key in ("OMP_NUM_THREADS", "STEPS", "TEST_WORKERS", "TESTS_TIMEOUT_S"):
            env.pop(key, None)
        for key in ("SESSION_LIMIT_S", "SGLANG_TESTS_TIMEOUT_S"):
            env.pop(key, None)
        env.update(env_extra)
        result = subprocess.run(
            ["bash", str(repo / "tools" / "gpu" / "gpu_session.sh"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return result, out

    return run


def test_session_passes(session):
    result, out = session("--tokens", "1", "4")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all steps passed" in result.stdout
    args = (out / "test_args").read_text().split()
    assert args[1:3] == ["-rsE", "-p"]  # skips and errors listed
    assert args[args.index("--record") + 1] == str(out / "test_record.json")
    assert (out / "bench.log").read_text() == f"bench.sh --out {out} --tokens 1 4\n"
    assert "--host-breakdown" in (out / "host.log").read_text()
    assert "table\ncProfile of\n" in result.stdout
    assert "profile line" not in result.stdout  # the host table only, not the profile
    assert "skips checked: all 63 expected" in (out / "tests.log").read_text()


def test_session_fails_on_an_unexpected_skip_and_still_runs_the_rest(session):
    log = EXPECTED_LOG.replace(
        "2504 passed", "SKIPPED [4] tests/test_ops.py:9: needs a CUDA GPU\n2504 passed"
    ).replace("63 skipped", "67 skipped")
    result, out = session(log_text=log)
    assert result.returncode == 1
    assert "  SKIPPED [4] tests/test_ops.py:9: needs a CUDA GPU" in result.stdout
    assert "FAILED: tests (logs in" in result.stdout
    assert (out / "bench.log").exists() and (out / "host.log").exists()
    assert "needs a CUDA GPU" in (out / "tests.log").read_text().split("tests rc=")[-1]


@pytest.mark.parametrize(
    "kw, failed",
    [
        ({"test_rc": 1}, "tests"),
        ({"gpus": 0}, "tests"),
        ({"bench_rc": 3}, "bench"),
        ({"host_rc": 1}, "host"),
        ({"gpus": 2}, "tests"),
    ],
)
def test_session_names_the_failed_step(session, kw, failed):
    result, _ = session(**kw)
    assert result.returncode == 1
    assert f"gpu_session: FAILED: {failed} (logs in" in result.stdout


def test_session_shares_the_cpus_among_the_test_workers(session):
    """Each pytest-xdist worker gets its share of the CPUs as torch's thread count (for
    pytest alone: the timings keep torch's default), and a test running long dumps its
    stack (faulthandler_timeout)."""
    result, out = session(env_extra={"TEST_WORKERS": "2"})
    assert result.returncode == 0, result.stdout + result.stderr
    args = (out / "test_args").read_text().split()
    assert args[args.index("-n") + 1] == "2" and "faulthandler_timeout=180" in args
    assert (out / "test_threads").read_text().strip() == "8"  # 16 CPUs, 2 workers
    assert (out / "bench_threads").read_text().strip() == "unset"
    result, out = session(env_extra={"TEST_WORKERS": "2", "OMP_NUM_THREADS": "3"})
    assert (out / "test_threads").read_text().strip() == "3"  # the caller's setting stands


def test_session_interrupts_tests_that_run_too_long(session):
    """At TESTS_TIMEOUT_S the tests step is interrupted with SIGINT (pytest then prints
    its summary and writes its record) and named as failed; the other steps still run."""
    result, out = session(env_extra={"FAKE_TEST_SLEEP": "30", "TESTS_TIMEOUT_S": "1"})
    assert result.returncode == 1
    assert "tests INTERRUPTED after 1 s" in result.stdout
    assert "=== 3 passed, 1 skipped (interrupted) ===" in (out / "tests.log").read_text()
    assert "FAILED: tests (logs in" in result.stdout
    assert (out / "bench.log").exists()


@pytest.mark.parametrize("exit_status, passes", [(0, True), (1, False)])
def test_session_limit_while_pytest_exits(session, exit_status, passes):
    """The limit coming after pytest finished (its record written with exit status 0, while
    its workers shut down) is not a failure: the step says so and passes. A record of a
    failed run stays a failure."""
    env = {"FAKE_SLOW_EXIT": str(exit_status), "TESTS_TIMEOUT_S": "1", "STEPS": "tests"}
    result, out = session(env_extra=env)
    assert (result.returncode == 0) is passes, result.stdout
    said = "every test finished and passed (the record: exit status 0)"
    assert (said in result.stdout) is passes, result.stdout
    assert ("tests INTERRUPTED after 1 s" in result.stdout) is not passes, result.stdout


@pytest.mark.parametrize("session_limit, lowest, highest", [(400, 390, 400), (0, 60, 60)])
def test_tests_limit_is_what_is_left_of_the_session(session, session_limit, lowest, highest):
    """By default the tests run until the session's limit (what the set-up left of it),
    60 s at the least."""
    result, _ = session(env_extra={"SESSION_LIMIT_S": str(session_limit)})
    assert result.returncode == 0, result.stdout + result.stderr
    limit = re.search(r"tests: interrupted at (\d+) s if not done by then", result.stdout)
    assert limit and lowest <= int(limit.group(1)) <= highest, result.stdout


VLLM_SKIP_LOG = EXPECTED_LOG.replace("63 skipped", "65 skipped").replace(
    "2504 passed",
    "SKIPPED [2] tests/test_probe_engine_gpu.py:81: vLLM's CUDA build is not "
    "installed (the GPU machine: carry tools/gpu/make_vllm_engine_bundle.sh's .vllm_engine and .whl)"
    "\n2504 passed",
)


def test_session_without_the_vllm_bundle_says_what_did_not_run(session):
    result, _ = session(log_text=VLLM_SKIP_LOG)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "NOT RUN: the vLLM-engine GPU tests" in result.stdout


@pytest.mark.parametrize("install_rc", [0, 1])
def test_session_with_the_vllm_bundle_installs_it_and_refuses_the_skip(
    session, tmp_path, install_rc
):
    """Carried, the bundle is installed and the vLLM-engine tests must run: their skip is
    then a failure; a bundle that does not install fails the session's vllm step."""
    repo = tmp_path / "repo"
    for folder in (".vllm_engine", ".whl"):
        (repo / folder).mkdir()
    _write(repo / "tools" / "gpu" / "gpu_vllm_engine.sh", f"echo installed; exit {install_rc}\n")
    result, out = session(log_text=VLLM_SKIP_LOG)
    assert result.returncode == 1
    assert "NOT RUN: the vLLM" not in result.stdout
    if install_rc:
        assert "FAILED: vllm tests" in result.stdout
    else:
        assert "installed from the carried bundle" in result.stdout
        assert "FAILED: tests (logs in" in result.stdout
        assert "vLLM's CUDA build is not installed" in result.stdout


SGLANG_SKIP_LOG = EXPECTED_LOG.replace("63 skipped", "65 skipped").replace(
    "2504 passed",
    "SKIPPED [2] tests/test_probe_sglang_gpu.py:108: SGLang is not installed (the GPU "
    "machine: carry tools/gpu/make_sglang_engine_bundle.sh's .sglang_engine and .whl_sglang)"
    "\n2504 passed",
)


def test_session_without_the_sglang_bundle_says_what_did_not_run(session):
    """The tests step never has SGLang (its skip is expected); the sglang step, without the
    bundle, says that its tests did not run."""
    result, out = session(log_text=SGLANG_SKIP_LOG)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "NOT RUN: the SGLang-engine GPU tests" in result.stdout
    assert not (out / "sglang_path").exists()


TP2_SKIP = (
    "SKIPPED [1] tests/test_probe_sglang_gpu.py:162: needs two GPUs (tensor parallel 2 over NCCL)"
    "\n5 passed, 1 skipped in 300.0s\n"
)


@pytest.mark.parametrize(
    "install_rc, sglang_log, sglang_rc, gpus, failed",
    [
        (0, "6 passed in 300.0s\n", 0, 1, None),
        (
            0,
            "SKIPPED [6] tests/test_probe_sglang_gpu.py:108: SGLang is not installed\n",
            0,
            1,
            "its tests skipped",
        ),
        (0, TP2_SKIP, 0, 1, None),  # the TP 2 test on a one-GPU machine
        (0, TP2_SKIP, 0, 2, "its tests skipped"),  # ... on two GPUs it must run
        (0, "1 failed, 5 passed\n", 1, 1, "pytest exit status 1"),
        (1, "", 0, 1, "did not install"),
    ],
)
def test_session_with_the_sglang_bundle_runs_its_tests_with_sglang(
    session, tmp_path, install_rc, sglang_log, sglang_rc, gpus, failed
):
    """Carried, the bundle is installed and its tests run in a pytest of their own with
    SGLang's site first on the path; a skip there (SGLang did not import; a test needing no
    more GPUs than the machine has), a failure or an install that fails fails the session's
    sglang step."""
    repo = tmp_path / "repo"
    for folder in (".sglang_engine", ".whl_sglang"):
        (repo / folder).mkdir()
    _write(repo / "tools" / "gpu" / "gpu_sglang_engine.sh", f"echo installed; exit {install_rc}\n")
    log = tmp_path / "sglang.log"
    log.write_text(sglang_log)
    result, out = session(
        gpus=gpus,
        log_text=SGLANG_SKIP_LOG,
        env_extra={"FAKE_SGLANG_LOG": str(log), "FAKE_SGLANG_RC": str(sglang_rc)},
    )
    assert "NOT RUN: the SGLang" not in result.stdout
    if failed is None:
        assert result.returncode == 0, result.stdout + result.stderr
        assert (out / "sglang_path").read_text().startswith("/tmp/sglang_site")
        if "needs two GPUs" in sglang_log:  # said on the console, not only in a file
            assert "skips checked: all 1 expected on a machine with 1 GPU(s)" in result.stdout
    else:
        assert result.returncode == 1 and failed in result.stdout, result.stdout
        # (on two GPUs the stand-in tests step fails too: its canned log is a one-GPU one)
        assert re.search(r"FAILED: (tests )?sglang", result.stdout), result.stdout


# ---------------------------------------------------------------- gpu_vllm_engine.sh's install


def _wheel(path: Path, name: str, files: dict) -> None:
    """A minimal wheel of ``files`` (path -> text), enough for pip's --target install."""
    import zipfile

    info = f"{name}-1.0.dist-info"
    meta = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    entries = {**files, **meta}
    record = "".join(f"{f},,\n" for f in entries) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path / f"{name}-1.0-py3-none-any.whl", "w") as z:
        for f, text in {**entries, f"{info}/RECORD": record}.items():
            z.writestr(f, text)


def test_vllm_034_install_keeps_the_cutlass_libraries_whatever_the_order(tmp_path):
    """vLLM 0.34's bundle arrives over several calls; the cutlass libraries' two halves may
    come before the wheels. pip's --target install replaces the whole nvidia_cutlass_dsl/
    folder, so the libraries are unpacked only once the wheels are in: both the wheel's
    package and the libraries are there at the end."""
    import tarfile

    repo, site = tmp_path / "repo", tmp_path / "site"
    (repo / "tools" / "gpu").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "tools", "gpu", "gpu_vllm_engine.sh"), repo / "tools" / "gpu")
    engine = repo / ".vllm_engine"
    engine.mkdir()
    (engine / "VERSION").write_text("0.34.0\n")
    stub = tmp_path / "stub"
    (stub / "vllm").mkdir(parents=True)
    (stub / "vllm" / "__init__.py").write_text("")
    with tarfile.open(engine / "vllm_rest.tar.xz", "w:xz") as t:
        t.add(stub / "vllm", "vllm")
    libs = tmp_path / "libs" / "nvidia_cutlass_dsl" / "cu13" / "lib"
    libs.mkdir(parents=True)
    (libs / "libcute_dsl_runtime.so").write_text("a library")
    with tarfile.open(tmp_path / "libs.tar.xz", "w:xz") as t:
        t.add(tmp_path / "libs" / "nvidia_cutlass_dsl", "nvidia_cutlass_dsl")
    data = (tmp_path / "libs.tar.xz").read_bytes()
    for i, part in enumerate((data[: len(data) // 2], data[len(data) // 2 :])):
        (repo / f".vllm_cutlass_{i}").mkdir()
        (repo / f".vllm_cutlass_{i}" / f"part{i}").write_bytes(part)
    site.mkdir()
    (site / ".ok").write_text("")  # the package's own install: not this test's
    env = dict(
        os.environ,
        VLLM_SITE=str(site),
        PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
    )
    script = ["bash", str(repo / "tools" / "gpu" / "gpu_vllm_engine.sh"), "--vllm", "0.34.0"]
    # Call 1: the engine and both halves, no wheels yet.
    first = subprocess.run(script, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "not installed yet on this machine: carry .whl" in first.stdout
    # Call 2: the wheels alone (the halves' folders are not carried again).
    for i in (0, 1):
        shutil.rmtree(repo / f".vllm_cutlass_{i}")
    (repo / ".whl").mkdir()
    _wheel(
        repo / ".whl",
        "nvidia_cutlass_dsl_libs_core",
        {"nvidia_cutlass_dsl/dsl_packages/cutlass/__init__.py": "Float8E4M3FN = 1\n"},
    )
    second = subprocess.run(script, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "vLLM 0.34.0 installed in" in second.stdout
    assert (site / "nvidia_cutlass_dsl" / "dsl_packages" / "cutlass" / "__init__.py").is_file()
    assert (site / "nvidia_cutlass_dsl" / "cu13" / "lib" / "libcute_dsl_runtime.so").is_file()


# ---------------------------------------------------------------- FlashInfer's norm, the peer

fi = _load("flashinfer_norm")


def _fake_bundle(root, version="9.9.9", wheel=True):
    """A bundle as tools/gpu/make_gpu_bundle.sh lays it out: the trimmed tree (here a
    two-file stand-in) and the tvm-ffi wheel (a zip of site-packages files)."""
    import tarfile
    import zipfile

    src = root / "src"
    (src / "flashinfer").mkdir(parents=True)
    (src / "flashinfer" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    bundle = root / "bundle"
    (bundle / "wheels").mkdir(parents=True)
    with tarfile.open(bundle / f"flashinfer-{version}-norm.tar.xz", "w:xz") as tar:
        tar.add(src / "flashinfer", arcname="flashinfer")
    if wheel:
        with zipfile.ZipFile(
            bundle / "wheels" / "apache_tvm_ffi-0.1.11-cp312-abi3-x.whl", "w"
        ) as z:
            info = zipfile.ZipInfo("tvm_ffi/lib/libtvm_ffi.so")
            info.external_attr = 0o755 << 16
            z.writestr(info, b"\x7fELF")
    return bundle


@pytest.mark.parametrize("tar_filters", [True, False])
def test_flashinfer_bundle_parts_and_unpack(tmp_path, monkeypatch, tar_filters):
    """(tar_filters False: a Python whose tarfile has no extraction filters, 3.11.0 - 3.11.3.)"""
    import tarfile

    if not tar_filters:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    bundle = _fake_bundle(tmp_path)
    parts = fi.bundle_parts(bundle)
    assert parts["version"] == "9.9.9" and len(parts["wheels"]) == 1
    assert parts["prebuilt"] is None
    assert fi.bundle_parts(tmp_path / "nowhere") is None
    site = tmp_path / "site"
    fi.unpack(parts, site)
    assert (site / "flashinfer" / "__init__.py").read_text() == "__version__ = '9.9.9'\n"
    so = site / "tvm_ffi" / "lib" / "libtvm_ffi.so"
    assert so.read_bytes() == b"\x7fELF" and os.access(so, os.X_OK)  # the .so stays executable
    (site / "flashinfer" / "__init__.py").write_text("edited")
    fi.unpack(parts, site)  # unpacked once per bundle: a second call keeps the files
    assert (site / "flashinfer" / "__init__.py").read_text() == "edited"


def test_flashinfer_load_says_why_not(tmp_path, monkeypatch):
    """Without an importable flashinfer: no bundle -> the line names the script that
    makes one; a bundle but no GPU -> says so. Never raises."""
    monkeypatch.setattr(fi, "_installed", lambda: (None, "ModuleNotFoundError: flashinfer"))
    monkeypatch.setenv(fi.BUNDLE_ENV, str(tmp_path / "none"))
    fn, line = fi.load()
    assert fn is None and "FLASHINFER_ONLY=1 bash tools/gpu/make_gpu_bundle.sh" in line
    assert "ModuleNotFoundError" in line
    monkeypatch.setenv(fi.BUNDLE_ENV, str(_fake_bundle(tmp_path)))
    monkeypatch.setattr(
        torch.cuda,
        "get_device_capability",
        lambda *a: (_ for _ in ()).throw(RuntimeError("no GPU")),
    )
    fn, line = fi.load()
    assert fn is None and line.startswith("no CUDA GPU")
