"""Shared test set-up.

Without a GPU, the Triton kernels run under Triton's CPU interpreter: the
variable must be set before ``eagle_capture`` (and so ``triton.jit``) is
imported, which is why it is set here at collection time. On a GPU machine
the kernels run compiled and the interpreter stays off.
"""

import datetime
import json
import os
import platform
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One torch (OpenMP) thread per process, here and in every process the tests start
    # (they inherit it), unless the caller set OMP_NUM_THREADS: the background engine
    # runs keep more processes busy than there are cores, and torch's OpenMP threads
    # spin-wait at every parallel region's barrier for a peer that has no core -- on the
    # tiny tensors of these tests that spinning is most of the CPU time. 2-core machine,
    # tests/test_probe.py beside two busy processes: 72 CPU-s and 87 s with torch's 2
    # threads, 29 CPU-s and 44 s with one (36 CPU-s, 27 s alone). GPU machines keep
    # torch's default.
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)

import pytest  # noqa: E402

# The package loads its ops on first use; tests call them by their torch name too.
import eagle_capture.ops  # noqa: E402,F401

HAS_CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]

# Tolerances for the *normed* output only (captures and residuals are compared
# bit-exactly). The kernel computes in fp32 and rounds once; the reference is
# float64. So the error is one rounding of the output dtype (<= 1/2 ulp,
# relative 2^-8 for bf16, 2^-11 for fp16) plus fp32 reduction-order noise that
# can push a value across a rounding boundary: allow one full ulp.
NORM_TOLERANCES = {
    torch.bfloat16: dict(rtol=2**-7, atol=1e-5),
    torch.float16: dict(rtol=2**-10, atol=1e-5),
    torch.float32: dict(rtol=1e-5, atol=1e-6),
}
# Triton's interpreter truncates fp32 -> bf16 (docs/engine_facts.md section 4) instead of
# rounding to nearest even: up to one full ulp from the cast alone, so the
# interpreter gets one more ulp for bf16. fp16 and fp32 casts are exact there.
INTERPRETER_NORM_TOLERANCES = dict(NORM_TOLERANCES)
INTERPRETER_NORM_TOLERANCES[torch.bfloat16] = dict(rtol=2**-6, atol=1e-5)


def make_rows(
    num_tokens: int,
    hidden_size: int,
    dtype,
    device,
    *,
    strided: bool = False,
    generator=None,
    pad: int = 3,
) -> torch.Tensor:
    """Random ``[T, H]`` rows; ``strided`` gives a row stride of ``2H + pad`` (a view of
    a wider tensor, as a column slice of a fused projection would be). Two inputs
    with different ``pad`` have different strides, so a kernel reading one through
    the other's pointer or stride goes wrong."""
    if strided:
        base = torch.randn(num_tokens, 2 * hidden_size + pad, generator=generator)
        return base.to(dtype=dtype, device=device)[:, 1 : hidden_size + 1]
    return torch.randn(num_tokens, hidden_size, generator=generator).to(dtype=dtype, device=device)


def poisoned_aux(rows: int, slots: int, hidden_size: int, dtype, device) -> torch.Tensor:
    return torch.full((rows, slots, hidden_size), float("nan"), dtype=dtype, device=device)


def truncate_to_bf16(x_fp32: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 by dropping the low 16 bits: the interpreter's cast."""
    return (x_fp32.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)


def assert_untouched(aux: torch.Tensor, num_tokens: int, slot: int) -> None:
    """Everything but ``aux[:T, slot]`` must still be the NaN poison."""
    mask = torch.ones(aux.shape[:2], dtype=torch.bool, device=aux.device)
    mask[:num_tokens, slot] = False
    assert torch.isnan(aux[mask]).all(), "a capture wrote outside its slot"


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equality of the bits, NaN included (torch.equal treats NaN != NaN)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    int_type = {2: torch.int16, 4: torch.int32}[actual.element_size()]
    a = actual.contiguous().view(int_type)
    e = expected.contiguous().view(int_type)
    if not torch.equal(a, e):
        bad = (a != e).sum().item()
        raise AssertionError(f"{bad} of {a.numel()} elements differ bitwise")


def run_spawned(fn, args, nprocs: int, timeout_s: float, what: str) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes; fail the test
    (killing them) if they have not all finished within ``timeout_s`` -- a hung
    collective or barrier must not hang CI. A worker's exception fails the join."""
    import time

    import torch.multiprocessing as mp

    ctx = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{what} did not finish within {timeout_s} s")


def _rank(rank, world, store_dir, scenarios, timeout_s, backend):
    """One rank of :func:`run_ranks` (a top-level function: spawn pickles it)."""
    import os
    import sys
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(__file__))
    if backend == "nccl":
        from eagle_capture.parallel.symm import ensure_multicast_disabled

        ensure_multicast_disabled()  # before NCCL starts
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        device_id = {"device_id": device}
    else:  # gloo: CPU ranks sharing the cores
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(1)
        device, device_id = torch.device("cpu"), {}
    dist.init_process_group(
        backend,
        init_method=f"file://{store_dir}/store",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
        **device_id,
    )
    try:
        scenarios(rank, world, device)
        dist.barrier()
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def run_ranks(
    scenarios, world: int, store_dir, timeout_s: float, what: str, backend: str = "nccl"
) -> None:
    """``scenarios(rank, world, device)`` (a module-level function) in ``world``
    spawned processes: NCCL with one GPU per rank and multicast off, or gloo on
    CPU; bounded by ``timeout_s`` (:func:`run_spawned`)."""
    run_spawned(
        _rank, (world, str(store_dir), scenarios, timeout_s, backend), world, timeout_s, what
    )


# ----------------------------------------------------------------------------
# --record JSON: per-file outcome counts of this run, the record the README's
# reliability table cites (tools/test_record.py renders docs/test_runs.md).
# ----------------------------------------------------------------------------


def pytest_addoption(parser):
    parser.addoption(
        "--record",
        metavar="JSON",
        default=None,
        help="write this run's outcome counts per test file, and the machine, here",
    )


def pytest_sessionstart(session):
    session.config._record_started = time.time()


def pytest_collection_modifyitems(config, items):
    """Engine tests are marked ``engines`` and go last: their runs start in the
    background when the session starts, while the other tests run."""
    engines = set()
    for item in items:
        if hasattr(getattr(item, "module", None), "engine_jobs"):
            item.add_marker(pytest.mark.engines)
            engines.add(item)
    items.sort(key=lambda item: item in engines)  # stable: the order within each part stays


# ----------------------------------------------------------------------------
# The engine runs (tests/engine_jobs.py): planned for the selected tests when the
# session starts, run in the background while the other tests run.
# ----------------------------------------------------------------------------


@pytest.fixture(scope="session", autouse=True)
def engine_jobs(request, tmp_path_factory):
    plans = [
        (item, plan)
        for item in request.session.items
        if (plan := getattr(getattr(item, "module", None), "engine_jobs", None))
    ]
    if not plans:  # nothing selected runs in the background
        yield None
        return
    from engine_env import close_servers
    from engine_jobs import EngineJobs

    jobs = EngineJobs()
    jobs.cleanups.append(close_servers)
    base = tmp_path_factory.getbasetemp()
    for item, plan in plans:
        for job in plan(item, base, jobs):
            jobs.submit(job)
    jobs.start()
    request.config._engine_jobs = jobs
    yield jobs
    jobs.stop()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    jobs = getattr(config, "_engine_jobs", None)
    lines = jobs.report() if jobs is not None else []
    if lines:
        terminalreporter.section("engine runs")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    path = session.config.getoption("--record")
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    # An xdist worker sees its share of the tests only: the controller writes the record
    # (a worker's, written first, would stand for the run where the controller never ends).
    if not path or reporter is None or hasattr(session.config, "workerinput"):
        return
    files: dict = {}
    for outcome in ("passed", "failed", "error", "skipped", "xfailed", "xpassed"):
        for report in reporter.stats.get(outcome, []):
            if outcome == "passed" and getattr(report, "when", "call") != "call":
                continue
            counts = files.setdefault(report.nodeid.split("::")[0], {})
            counts[outcome] = counts.get(outcome, 0) + 1
    import triton

    record = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(0) if HAS_CUDA else "CPU (kernels interpreted)",
        "gpus": torch.cuda.device_count() if HAS_CUDA else 0,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "exit_status": int(exitstatus),
        "seconds": round(time.time() - getattr(session.config, "_record_started", time.time())),
        "files": dict(sorted(files.items())),
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
