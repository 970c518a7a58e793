"""CachedLauncher's decisions, with a stand-in for the Triton kernel (runs
anywhere): which launches may reuse a compiled kernel and which must go
through Triton's own entry point. The real launches are covered on the GPU
by test_torch_integration.py::test_eager_fast_path_alignment_and_reuse."""

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


def test_cached_keys_lists_what_was_compiled(fake):
    jit, launcher = fake
    assert launcher.cached_keys() == []
    launcher((2, 1), (1,), key="a", num_warps=4, device_index=0, aligned=True)
    launcher((2, 1), (1,), key="b", num_warps=4, device_index=0, aligned=False)  # not cached
    assert launcher.cached_keys() == ["a"]


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


class OtherLauncher(RawForwardingLauncher):
    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.log.append(("wrapped", args))


def _compiled_with(run):
    compiled = FakeCompiled(run.log)
    compiled.run = run
    return compiled


def test_raw_launch_is_called_directly_only_for_the_known_forwarding_form():
    log = []
    run = RawForwardingLauncher(log)
    direct = _launcher.direct_launch_of(_compiled_with(run))
    assert direct.launch == run.launch  # the C launch itself, no Python frame between
    direct.launch(2, 1, 1, "stream", *direct.mid, 11, 12)
    # Exactly what the forwarding __call__ would have passed to launch.
    run(2, 1, 1, "stream", "fn", "meta", None, None, None, 11, 12)
    assert log[0] == log[1]

    other = OtherLauncher(log)
    direct = _launcher.direct_launch_of(_compiled_with(other))
    assert direct.launch == other  # anything else goes through the launcher object


def test_scratch_space_keeps_the_launcher_object():
    run = RawForwardingLauncher([])
    run.global_scratch_size = 128
    assert _launcher.direct_launch_of(_compiled_with(run)).launch == run


def test_cached_launch_returns_the_direct_launch_for_memoising(fake):
    jit, launcher = fake
    assert launcher((2, 1), (1,), key="k", num_warps=4, device_index=0, aligned=True) is None
    direct = launcher((2, 1), (1,), key="k", num_warps=4, device_index=0, aligned=True)
    assert direct is not None and direct.mid[0] == "fn"
    assert launcher((2, 1), (1,), key="k", num_warps=4, device_index=0, aligned=False) is None
