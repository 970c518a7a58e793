"""CachedLauncher's decisions, with a stand-in for the Triton kernel (runs
anywhere): which launches may reuse a compiled kernel and which must go
through Triton's own entry point. The real launches are covered on the GPU
by test_torch_integration.py::test_eager_fast_path_alignment_and_reuse."""

import inspect

import pytest
import triton

from eagle_capture import _launcher


class FakeCompiled:
    def __init__(self, log):
        self.log, self.function, self.packed_metadata = log, "fn", "meta"

    def run(self, gx, gy, gz, stream, function, packed_metadata, launch_metadata, enter, exit_,
            *args):
        self.log.append(("direct", (gx, gy), args))


class FakeJit:
    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, num_warps):
            self.log.append(("triton", grid, args))
            return FakeCompiled(self.log)
        return launch


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(_launcher.torch._C, "_cuda_getCurrentRawStream", lambda i: 0,
                        raising=False)
    jit = FakeJit()
    launcher = _launcher.CachedLauncher(jit)
    if not launcher.direct:
        pytest.skip("this Triton has no direct-launch support; every launch is Triton's own")
    return jit, launcher


def test_first_call_compiles_then_reuses(fake):
    jit, launcher = fake
    launcher((2, 1), (1, 2), key="k", num_warps=4, device_index=0, aligned=True)
    launcher((3, 1), (5, 6), key="k", num_warps=4, device_index=0, aligned=True)
    assert [kind for kind, *_ in jit.log] == ["triton", "direct"]
    assert jit.log[1][1:] == ((3, 1), (5, 6))  # the new grid and arguments are used


def test_only_aligned_launches_are_cached(fake):
    jit, launcher = fake
    assert list(launcher._compiled) == []
    launcher((2, 1), (1,), key="a", num_warps=4, device_index=0, aligned=True)
    launcher((2, 1), (1,), key="b", num_warps=4, device_index=0, aligned=False)  # not cached
    assert list(launcher._compiled) == ["a"]


def test_unaligned_launches_never_reuse(fake):
    jit, launcher = fake
    launcher((2, 1), (1,), key="k", num_warps=4, device_index=0, aligned=True)
    launcher((2, 1), (1,), key="k", num_warps=4, device_index=0, aligned=False)
    launcher((2, 1), (1,), key="k", num_warps=4, device_index=0, aligned=False)
    assert [kind for kind, *_ in jit.log] == ["triton", "triton", "triton"]


def test_a_new_key_compiles_again(fake):
    jit, launcher = fake
    launcher((1, 1), (1,), key="a", num_warps=4, device_index=0, aligned=True)
    launcher((1, 1), (1,), key="b", num_warps=4, device_index=0, aligned=True)
    assert [kind for kind, *_ in jit.log] == ["triton", "triton"]


def test_active_profiler_hooks_take_tritons_path(fake, monkeypatch):
    jit, launcher = fake
    hook = triton.knobs.runtime.launch_enter_hook
    launcher((1, 1), (1,), key="k", num_warps=4, device_index=0, aligned=True)
    if hasattr(hook, "calls"):
        monkeypatch.setattr(hook, "calls", [lambda *a: None])
    else:
        monkeypatch.setattr(triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    launcher((1, 1), (1,), key="k", num_warps=4, device_index=0, aligned=True)
    assert [kind for kind, *_ in jit.log] == ["triton", "triton"]


class RawForwardingLauncher:
    """Triton 3.6's CudaLauncher.__call__, in shape: scratch, then the C launch."""

    def __init__(self, log):
        self.log, self.global_scratch_size, self.profile_scratch_size = log, 0, 0
        self.launch_cooperative_grid, self.launch_pdl = False, True

    def launch(self, *args):
        self.log.append(("raw", args))

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        global_scratch = profile_scratch = None
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    global_scratch, profile_scratch, *args)


class MetadataByNameLauncher(RawForwardingLauncher):
    """Triton 3.9's CudaLauncher.__call__, in shape: the launch metadata by name."""

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata,
                 launch_enter_hook, launch_exit_hook, *args):
        self.log.append(("wrapped", args))


def _compiled_with(run):
    compiled = FakeCompiled(getattr(run, "log", []))
    compiled.run = run
    return compiled


@pytest.fixture
def raw_release(monkeypatch):
    """As on a Triton release whose launcher forwarding is known (3.6)."""
    monkeypatch.setattr(_launcher, "_RAW_FORWARDING", True)


def test_raw_launch_is_called_directly_only_for_the_known_forwarding_form(raw_release):
    log = []
    run = RawForwardingLauncher(log)
    direct = _launcher.direct_launch_of(_compiled_with(run))
    assert direct.launch == run.launch  # the C launch itself, no Python frame between
    direct.launch(2, 1, 1, "stream", *direct.mid, 11, 12)
    # Exactly what the forwarding __call__ would have passed to launch.
    run(2, 1, 1, "stream", "fn", "meta", None, None, None, 11, 12)
    assert log[0] == log[1]

    other = MetadataByNameLauncher(log)
    direct = _launcher.direct_launch_of(_compiled_with(other))
    assert direct.launch == other  # another call signature goes through the launcher object
    assert direct.mid == ("fn", "meta", None, None, None)  # CompiledKernel.run's call form


def test_scratch_space_keeps_the_launcher_object(raw_release):
    run = RawForwardingLauncher([])
    run.global_scratch_size = 128
    assert _launcher.direct_launch_of(_compiled_with(run)).launch == run


class EarlierLauncher:
    """An earlier driver.py's CudaLauncher, in shape: the same call signature, but
    ``launch`` takes no PDL flag and no profile scratch (it has neither attribute)."""

    def __init__(self, log):
        self.log, self.global_scratch_size, self.launch_cooperative_grid = log, 0, False

    def launch(self, *args):
        self.log.append(("raw", args))

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, None,
                    *args)


def test_an_earlier_forwarding_form_keeps_the_launcher_object(raw_release):
    run = EarlierLauncher([])
    assert _launcher.direct_launch_of(_compiled_with(run)).launch == run


def test_raw_launch_only_on_a_release_whose_forwarding_is_known(monkeypatch):
    monkeypatch.setattr(_launcher, "_RAW_FORWARDING", False)
    run = RawForwardingLauncher([])
    assert _launcher.direct_launch_of(_compiled_with(run)).launch == run
    assert _launcher._RAW_FORWARDING_RELEASES == frozenset({(3, 6)})


def test_the_forwarding_form_is_recognised_without_reading_source(raw_release, monkeypatch):
    def no_source(*args, **kwargs):
        raise OSError("source not available")
    monkeypatch.setattr(_launcher.inspect, "getsource", no_source)
    monkeypatch.setattr(_launcher.inspect, "getsourcelines", no_source)
    run = RawForwardingLauncher([])
    assert _launcher.direct_launch_of(_compiled_with(run)).launch == run.launch


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
    direct = _launcher.direct_launch_of(_compiled_with(run))
    assert (direct.launch == run.launch) is raw
    assert (direct.launch == run) is not raw


def test_cached_launch_returns_the_direct_launch_for_memoising(fake):
    jit, launcher = fake
    assert launcher((2, 1), (1,), key="k", num_warps=4, device_index=0, aligned=True) is None
    direct = launcher((2, 1), (1,), key="k", num_warps=4, device_index=0, aligned=True)
    assert direct is not None and direct.mid[0] == "fn"
    assert launcher((2, 1), (1,), key="k", num_warps=4, device_index=0, aligned=False) is None
