"""The eager fast path's launch decisions (``launcher.FastLaunch``), with a stand-in
for the Triton kernel (runs anywhere): which launches of a plan may reuse the
compiled kernel and which must go through Triton's own entry point. The real
launches are covered on the GPU by
test_torch_integration.py::test_eager_fast_path_alignment_and_reuse."""

import inspect

import pytest
import torch
import triton

from eagle_capture.ops import launcher as ops


class FakeCompiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def run(
        self, gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter, exit_, *args
    ):
        self.log.append(("direct", (gx, gy), args))


class FakeJit:
    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, num_warps):
            self.log.append(("triton", grid, args))
            return FakeCompiled(self.log)

        return launch


def kernel(a_ptr, b_ptr, n, FLAG=False): ...


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(ops.torch._C, "_cuda_getCurrentRawStream", lambda i: 0, raising=False)
    if not ops.DIRECT_LAUNCH:
        pytest.skip("this Triton has no direct-launch support; every launch is Triton's own")
    jit = FakeJit()
    fast = ops.FastLaunch(kernel, direct_launch=True)  # whatever the environment says
    fast.kernel = jit
    plan = fast.plan(
        (2, 1),
        {"n": 7},
        {"a_ptr": 0, "b_ptr": 1},
        num_warps=4,
        device_index=0,
        use_pdl=False,
        extents=(0, 0),
    )
    return jit, fast, plan


A, B = torch.zeros(4), torch.zeros(4)  # stand-in tensors; the addresses below are made up


def test_first_launch_compiles_then_reuses_with_the_new_addresses(fake):
    jit, fast, plan = fake
    fast.launch(plan, (A, B), (16, 32))
    fast.launch(plan, (B, A), (64, 48))
    assert [kind for kind, *_ in jit.log] == ["triton", "direct"]
    assert jit.log[0][2] == (A, B, 7, False)  # Triton's entry: the tensors
    assert jit.log[1][1:] == ((2, 1), (64, 48, 7, False))  # the direct launch: addresses


def test_unaligned_launches_never_reuse_nor_cache(fake):
    jit, fast, plan = fake
    fast.launch(plan, (A, B), (16, 33))  # unaligned: not cached
    assert plan.direct is None
    fast.launch(plan, (A, B), (16, 32))  # cached now
    fast.launch(plan, (A, B), (16, 40))  # unaligned: Triton's entry again
    assert [kind for kind, *_ in jit.log] == ["triton", "triton", "triton"]


def test_a_cpu_plan_never_caches(fake):
    jit, fast, _ = fake
    plan = fast.plan((2, 1), {"n": 7}, {"a_ptr": 0, "b_ptr": 1}, 4, None, False, (0, 0))
    fast.launch(plan, (A, B), (16, 32))
    fast.launch(plan, (A, B), (16, 32))
    assert [kind for kind, *_ in jit.log] == ["triton", "triton"] and plan.direct is None


def test_active_profiler_hooks_take_tritons_path(fake, monkeypatch):
    jit, fast, plan = fake
    hook = triton.knobs.runtime.launch_enter_hook
    fast.launch(plan, (A, B), (16, 32))
    if hasattr(hook, "calls"):
        monkeypatch.setattr(hook, "calls", [lambda *a: None])
    else:
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    fast.launch(plan, (A, B), (16, 32))
    assert [kind for kind, *_ in jit.log] == ["triton", "triton"]


def test_fixed_tensor_arguments_go_to_the_direct_launch_as_addresses(fake):
    jit, fast, _ = fake
    fast.signature = ops.KernelSignature(lambda a_ptr, b_ptr, state_ptr, n: None)
    state = torch.zeros(2)
    plan = fast.plan(
        (1, 1), {"state_ptr": state, "n": 3}, {"a_ptr": 0, "b_ptr": 1}, 4, 0, False, (0, 0)
    )
    fast.launch(plan, (A, B), (16, 32))
    fast.launch(plan, (A, B), (16, 32))
    assert jit.log[0][2] == (A, B, state, 3)
    assert jit.log[1][2] == (16, 32, state.data_ptr(), 3)


def test_the_memo_is_cleared_when_full(fake, monkeypatch):
    _, fast, plan = fake
    monkeypatch.setattr(ops.FastLaunch, "MAX_PLANS", 2)
    fast.remember("a", plan)
    fast.remember("b", plan)
    fast.remember("c", plan)
    assert list(fast.plans) == ["c"]
    fast.remember(None, plan)  # no key (a non-tensor argument): not memoised
    assert list(fast.plans) == ["c"]


class RawForwardingLauncher:
    """Triton 3.6's CudaLauncher.__call__, in shape: scratch, then the C launch."""

    def __init__(self, log):
        self.log, self.global_scratch_size, self.profile_scratch_size = log, 0, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def launch(self, *args):
        self.log.append(("raw", args))

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = profile_scratch = None
        self.launch(
            gridX,
            gridY,
            gridZ,
            stream,
            function,
            self.launch_cooperative_grid,
            self.launch_pdl,
            global_scratch,
            profile_scratch,
            *args,
        )


class MetadataByNameLauncher(RawForwardingLauncher):
    """Triton 3.9's CudaLauncher.__call__, in shape: the launch metadata by name."""

    def __call__(
        self,
        gridX,
        gridY,
        gridZ,
        stream,
        function,
        kernel_metadata,
        launch_metadata,
        launch_enter_hook,
        launch_exit_hook,
        *args,
    ):
        self.log.append(("wrapped", args))


def _compiled_with(run):
    compiled = FakeCompiled(getattr(run, "log", []))
    compiled.run = run
    return compiled


@pytest.fixture
def raw_release(monkeypatch):
    """As on a Triton release whose launcher forwarding is known (3.6)."""
    monkeypatch.setattr(ops, "_RAW_FORWARDING", True)


def test_raw_launch_is_called_directly_only_for_the_known_forwarding_form(raw_release):
    log = []
    run = RawForwardingLauncher(log)
    direct = ops.direct_launch_of(_compiled_with(run))
    assert direct.launch == run.launch  # the C launch itself, no Python frame between
    direct.launch(2, 1, 1, "stream", *direct.mid, 11, 12)
    # Exactly what the forwarding __call__ would have passed to launch.
    run(2, 1, 1, "stream", "fn", "meta", None, None, None, 11, 12)
    assert log[0] == log[1]

    other = MetadataByNameLauncher(log)
    direct = ops.direct_launch_of(_compiled_with(other))
    assert direct.launch == other  # another call signature goes through the launcher object
    assert direct.mid == ("fn", "meta", None, None, None)  # CompiledKernel.run's call form


def test_scratch_space_keeps_the_launcher_object(raw_release):
    run = RawForwardingLauncher([])
    run.global_scratch_size = 128
    assert ops.direct_launch_of(_compiled_with(run)).launch == run


class EarlierLauncher:
    """An earlier driver.py's CudaLauncher, in shape: the same call signature, but
    ``launch`` takes no PDL flag and no profile scratch (it has neither attribute)."""

    def __init__(self, log):
        self.log, self.global_scratch_size, self.launch_cooperative_grid = log, 0, False

    def launch(self, *args):
        self.log.append(("raw", args))

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.launch(
            gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, None, *args
        )


def test_an_earlier_forwarding_form_keeps_the_launcher_object(raw_release):
    run = EarlierLauncher([])
    assert ops.direct_launch_of(_compiled_with(run)).launch == run


def test_raw_launch_only_on_a_release_whose_forwarding_is_known(monkeypatch):
    monkeypatch.setattr(ops, "_RAW_FORWARDING", False)
    run = RawForwardingLauncher([])
    assert ops.direct_launch_of(_compiled_with(run)).launch == run


def test_the_forwarding_form_is_recognised_without_reading_source(raw_release, monkeypatch):
    def no_source(*args, **kwargs):
        raise OSError("source not available")

    monkeypatch.setattr(ops.inspect, "getsource", no_source)
    monkeypatch.setattr(ops.inspect, "getsourcelines", no_source)
    run = RawForwardingLauncher([])
    assert ops.direct_launch_of(_compiled_with(run)).launch == run.launch


def test_installed_tritons_cuda_launcher_is_judged_by_its_call_signature(raw_release):
    """The installed Triton's own CudaLauncher class (no GPU needed: its instance is
    made without __init__): recognised as the raw-forwarding form exactly when its
    call signature is 3.6's."""
    driver = pytest.importorskip("triton.backends.nvidia.driver")
    run = object.__new__(driver.CudaLauncher)
    run.launch = lambda *args: None
    run.launch_cooperative_grid, run.launch_pdl = False, False
    run.global_scratch_size = run.profile_scratch_size = 0
    params = tuple(inspect.signature(driver.CudaLauncher.__call__).parameters)
    raw = params == ("self", "gridX", "gridY", "gridZ", "stream", "function", "args")
    direct = ops.direct_launch_of(_compiled_with(run))
    assert (direct.launch == run.launch) is raw
    assert (direct.launch == run) is not raw


def test_the_switch_back_to_tritons_own_launch(fake, monkeypatch):
    """EAGLE_CAPTURE_DIRECT_LAUNCH=0: every launch through Triton's entry point,
    the compiled kernel never kept."""
    jit, _, _ = fake
    monkeypatch.setenv("EAGLE_CAPTURE_DIRECT_LAUNCH", "0")
    fast = ops.FastLaunch(kernel)
    fast.kernel = jit
    plan = fast.plan((2, 1), {"n": 7}, {"a_ptr": 0, "b_ptr": 1}, 4, 0, False, (0, 0))
    for _ in range(3):
        fast.launch(plan, (A, B), (16, 32))
    assert [kind for kind, *_ in jit.log] == ["triton"] * 3 and plan.direct is None
    monkeypatch.setenv("EAGLE_CAPTURE_DIRECT_LAUNCH", "1")
    assert ops.FastLaunch(kernel).direct_launch
    assert not ops.FastLaunch(kernel, direct_launch=False).direct_launch


def test_a_zero_size_grid_launches_nothing(fake):
    jit, fast, _ = fake
    plan = fast.plan((0, 1), {"n": 7}, {"a_ptr": 0, "b_ptr": 1}, 4, 0, False, (0, 0))
    fast.launch(plan, (A, B), (16, 32))
    assert jit.log == []
