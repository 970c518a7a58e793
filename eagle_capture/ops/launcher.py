"""The eager fast path of a Triton kernel: a memo of validated call
signatures, the protocol that checks a call once per signature, and the
launch of a memoised plan. Used by the single-GPU ops
(:mod:`eagle_capture.ops.table`) and the all-reduce object
(:mod:`eagle_capture.parallel.symm`), each with its own kernel.

``kernel[grid](...)`` re-binds and re-specialises every argument (~17 us of
host time per launch on the H200 host); the raw launcher of the compiled
kernel takes ~4 us with integer addresses (benchmarks/NOTES.md). A plan holds
what a validated call signature launches with, everything but the addresses;
its first aligned launch goes through Triton's entry point, which returns the
compiled kernel, and later ones call that kernel's launcher directly. That is
sound because the memo key (shapes, strides, dtypes, devices, scalars) fixes
every argument Triton specialises on except pointer alignment, and only
all-16-byte-aligned calls launch directly.

``EAGLE_CAPTURE_DIRECT_LAUNCH=0`` (read when a :class:`FastLaunch` is made)
switches the direct launch off: every launch then goes through Triton's own
entry point, the memo and the checks unchanged -- the way back when a Triton
release changes its launcher.
"""

import contextlib
import functools
import inspect
import operator
import os
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import triton
from torch.library import wrap_triton

from eagle_capture.kernels import HAS_PDL
from eagle_capture.ops.checks import spans_meet

DIRECT_LAUNCH_ENV = "EAGLE_CAPTURE_DIRECT_LAUNCH"


def _triton_release() -> Optional[tuple[int, int]]:
    try:
        return tuple(int(p) for p in triton.__version__.split(".")[:2])
    except ValueError:
        return None


try:  # Triton >= 3.4 keeps the launch hooks in knobs
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton: no direct launches
    _knobs = None

# CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata, launch_metadata,
# enter_hook, exit_hook, *args) is JITFunction.run's own call in Triton 3.3 - 3.9.
_RELEASE = _triton_release()
DIRECT_LAUNCH = (
    _RELEASE is not None and _RELEASE[0] == 3 and _RELEASE[1] >= 3 and _knobs is not None
)


def _hook_active(hook) -> bool:
    # Triton 3.6+ keeps an always-present HookChain, active once a profiler adds a call.
    return hook is not None and bool(getattr(hook, "calls", True))


def hooks_active() -> bool:
    """A profiler's launch hooks are installed: launch through Triton's entry so it sees them."""
    return _hook_active(_knobs.runtime.launch_enter_hook) or _hook_active(
        _knobs.runtime.launch_exit_hook
    )


class DirectLaunch(NamedTuple):
    """``launch(gx, gy, gz, stream, *mid, *kernel_args)`` launches one compiled kernel;
    pointer arguments may be ints (device addresses)."""

    launch: Callable
    mid: tuple
    compiled: Any = None  # keeps the CompiledKernel (and its module) alive


# Triton 3.6's CudaLauncher.__call__(gridX, gridY, gridZ, stream, function, *args)
# only forwards to its C ``launch`` with the cooperative and PDL flags and two
# scratch buffers (None when both sizes are 0; read in 3.6.0's driver.py); calling
# ``launch`` itself saves ~1.5 us. Other releases forward differently (no PDL flag
# before, launch metadata by name in 3.9): they take CompiledKernel.run.
_RAW_FORWARDING = _RELEASE == (3, 6)
_RAW_FORWARDING_CALL = ("self", "gridX", "gridY", "gridZ", "stream", "function", "args")


def _forwards_to_raw_launch(run) -> bool:
    if not _RAW_FORWARDING:
        return False
    try:
        params = inspect.signature(type(run).__call__).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return (
        tuple(params) == _RAW_FORWARDING_CALL
        and params["args"].kind is inspect.Parameter.VAR_POSITIONAL
        and callable(getattr(run, "launch", None))
        and hasattr(run, "launch_cooperative_grid")
        and hasattr(run, "launch_pdl")
        and getattr(run, "global_scratch_size", 1) == 0
        and getattr(run, "profile_scratch_size", 1) == 0
    )


def direct_launch_of(compiled) -> DirectLaunch:
    run = compiled.run
    if _forwards_to_raw_launch(run):
        return DirectLaunch(
            run.launch,
            (
                compiled.function,
                run.launch_cooperative_grid,
                run.launch_pdl,
                None,
                None,
                compiled.packed_metadata,
                None,
                None,
                None,
            ),
            compiled,
        )
    return DirectLaunch(
        run, (compiled.function, compiled.packed_metadata, None, None, None), compiled
    )


def tuple_getter(indices) -> Callable[[Sequence], tuple]:
    """A tuple of the items at ``indices`` (a tuple even for one index)."""
    indices = tuple(indices)
    if len(indices) == 1:
        (i,) = indices
        return lambda items: (items[i],)
    return operator.itemgetter(*indices)


class KernelSignature:
    """A ``triton.jit`` kernel's parameters by name: the one place where a call's
    arguments, given by name, become the positional list Triton's launchers take."""

    def __init__(self, kernel) -> None:
        parameters = inspect.signature(getattr(kernel, "fn", kernel)).parameters
        self.params = tuple(parameters)
        self.defaults = {
            n: p.default for n, p in parameters.items() if p.default is not inspect.Parameter.empty
        }

    def bind(self, values: dict) -> tuple:
        """``values`` in parameter order, defaults filled in; TypeError naming
        unknown and missing parameters."""
        unknown = sorted(values.keys() - set(self.params))
        missing = [p for p in self.params if p not in values and p not in self.defaults]
        if unknown or missing:
            raise TypeError(
                f"eagle_capture: kernel arguments do not match the kernel's "
                f"signature (unknown {unknown}, missing {missing})"
            )
        return tuple(values[p] if p in values else self.defaults[p] for p in self.params)

    def template(self, sources: dict, values: dict) -> tuple[Callable, tuple]:
        """``(head, tail)``: ``(*head(pointers), *tail)`` is the argument list of a call
        whose leading pointer parameters take ``pointers[sources[p]]`` (tensors or
        addresses) and every other parameter its entry in ``values``."""
        lead = self.params[: len(sources)]
        if set(lead) != set(sources):
            raise TypeError(
                f"eagle_capture: the call's pointer parameters {sorted(sources)} "
                f"must lead the kernel's signature {self.params}"
            )
        bound = self.bind({**values, **dict.fromkeys(sources)})
        return tuple_getter(sources[p] for p in lead), bound[len(sources) :]


class Plan:
    """One validated call signature: its launch but for the tensors' addresses
    (``grid`` None: the kernel does not run on its device, the caller's torch
    path does), the byte extents of its tensors and of the fixed ranges the
    call must not meet, the addresses last found free of overlaps (the
    aliasing pre-check), and the compiled kernel's DirectLaunch once there is
    one."""

    __slots__ = (
        "grid",
        "head",
        "tail",
        "tail_entry",
        "num_warps",
        "device_index",
        "use_pdl",
        "extents",
        "fixed",
        "checked",
        "direct",
        "extra",
    )

    def __init__(
        self,
        grid,
        head,
        tail_entry,
        num_warps,
        device_index,
        use_pdl,
        extents,
        extra=None,
        fixed=(),
    ):
        self.grid, self.head, self.num_warps = grid, head, num_warps
        # Fixed tensor arguments (symm's state) go to Triton's entry as tensors,
        # to the direct launch as addresses.
        self.tail_entry = tail_entry
        self.tail = tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v for v in tail_entry)
        self.device_index, self.use_pdl = device_index, use_pdl
        # (start, bytes) ranges every call is compared with besides its own
        # tensors (symm: this rank's symmetric buffer, which peers write).
        self.fixed = tuple(start for start, _ in fixed)
        self.extents = tuple(extents) + tuple(size for _, size in fixed)
        self.checked = None
        self.direct: Optional[DirectLaunch] = None
        self.extra = extra  # the caller's own decision for this signature (symm: its path)

    def meets(self, ptrs: Sequence[int]) -> bool:
        """Whether, at the addresses ``ptrs``, two of the call's byte ranges (or
        one and a fixed range) intersect."""
        return spans_meet((*ptrs, *self.fixed) if self.fixed else ptrs, self.extents)


def addresses(tensors: Sequence) -> list:
    """The tensors' addresses, 0 for None."""
    return [t.data_ptr() if t is not None else 0 for t in tensors]


class FastLaunch:
    """The eager fast path of one Triton kernel: a memo of validated call
    signatures (``key -> Plan``, cleared when full), the check protocol of an
    eager call (:meth:`eager_plan`), the launch of a plan (:meth:`launch`) and
    the traced launch of the registered ops (:meth:`launch_traced`).

    ``kernel_devices``: the device types whose tensors the kernel launches on
    (the caller runs its torch path on others). ``direct_launch``: reuse the
    compiled kernel's launcher (default: on where this Triton supports it,
    unless ``EAGLE_CAPTURE_DIRECT_LAUNCH=0``)."""

    MAX_PLANS = 4096

    def __init__(
        self, kernel, *, kernel_devices=frozenset({"cuda"}), direct_launch: Optional[bool] = None
    ) -> None:
        self.kernel = kernel
        self.signature = KernelSignature(kernel)
        self.plans: dict = {}
        self.kernel_devices = frozenset(kernel_devices)
        if direct_launch is None:
            direct_launch = os.environ.get(DIRECT_LAUNCH_ENV, "1") != "0"
        self.direct_launch = DIRECT_LAUNCH and direct_launch

    def runs_kernel(self, device: torch.device) -> bool:
        return device.type in self.kernel_devices

    def forget(self) -> None:
        """Drop every memoised plan (the next call of each signature is checked again)."""
        self.plans.clear()

    def remember(self, key, plan: Plan) -> Plan:
        if key is not None:
            if len(self.plans) >= self.MAX_PLANS:
                self.plans.clear()
            self.plans[key] = plan
        return plan

    def plan(
        self,
        grid,
        values: dict,
        sources: dict,
        num_warps: int,
        device_index: Optional[int],
        use_pdl: bool,
        extents: tuple,
        extra=None,
        fixed=(),
    ) -> Plan:
        """The plan of a call whose pointer parameter ``p`` takes the call's tensor
        ``sources[p]`` (by position) and every other parameter ``values[p]``."""
        head, tail = self.signature.template(sources, values)
        return Plan(grid, head, tail, num_warps, device_index, use_pdl, extents, extra, fixed)

    def eager_plan(
        self,
        key,
        tensors: Sequence,
        call: tuple,
        check: Callable,
        check_aliasing: Callable,
        make_plan: Callable,
    ) -> tuple:
        """``(plan, addresses)`` of an eager call: on a memo miss ``check(*call)``
        (everything, before any address is read), then ``make_plan(*call)``
        remembered under ``key`` (None: a call that is never memoised); on a hit
        only the addresses are new, so only when two of the call's byte ranges
        meet (:meth:`Plan.meets`) is ``check_aliasing(*call)`` run, which raises
        or allows the overlap (a residual from another slot)."""
        plan = self.plans.get(key) if key is not None else None
        if plan is None:
            check(*call)
            plan = self.remember(key, make_plan(*call))
            plan.checked = addresses(tensors)
            return plan, plan.checked
        ptrs = [t.data_ptr() if t is not None else 0 for t in tensors]  # (inlined: per call)
        if ptrs != plan.checked:
            if plan.meets(ptrs):
                check_aliasing(*call)
            plan.checked = ptrs
        return plan, ptrs

    def memoised(self, key, call: tuple, make_plan: Callable) -> Plan:
        """The plan of a call already checked (a registered op's body)."""
        plan = self.plans.get(key) if key is not None else None
        if plan is None:
            plan = self.remember(key, make_plan(*call))
        return plan

    def launch(self, plan: Plan, tensors: Sequence, ptrs: Sequence[int]) -> None:
        """Launch ``plan`` on the call's ``tensors`` (``ptrs``: their addresses, 0 for None)."""
        if plan.grid[0] == 0:
            return  # a zero-size grid is not a valid launch
        direct = plan.direct
        aligned = not functools.reduce(operator.or_, ptrs) & 15
        if direct is not None and aligned and not hooks_active():
            direct.launch(
                plan.grid[0],
                plan.grid[1],
                1,
                torch._C._cuda_getCurrentRawStream(plan.device_index),
                *direct.mid,
                *plan.head(ptrs),
                *plan.tail,
            )
            return
        kwargs = {"num_warps": plan.num_warps}
        if plan.use_pdl:
            kwargs["launch_pdl"] = True
        compiled = self.kernel[plan.grid](*plan.head(tensors), *plan.tail_entry, **kwargs)
        if (
            self.direct_launch
            and aligned
            and plan.device_index is not None
            and not hooks_active()
            and compiled is not None
            and not hasattr(compiled, "result")
        ):  # not a future
            plan.direct = direct_launch_of(compiled)

    def launch_traced(self, grid, values: dict, num_warps: int, device: torch.device) -> None:
        """The launch of a registered op's body, through ``wrap_triton`` (what
        torch.compile traces); ``values``: every kernel argument by name."""
        if grid[0] == 0:
            return  # a zero-size grid is not a valid launch
        # Triton launches on the current device; the dispatcher may be called with
        # tensors elsewhere (compiled code sets its own guard).
        guard = (
            torch.cuda.device(device)
            if (
                device.type == "cuda"
                and not torch.compiler.is_compiling()
                and device.index != torch.cuda.current_device()
            )
            else contextlib.nullcontext()
        )
        with guard:
            wrap_triton(self.kernel)[grid](*self.signature.bind(values), num_warps=num_warps)


@functools.lru_cache(maxsize=None)
def pdl_enabled(device_index: int) -> bool:
    """Eager launches use programmatic dependent launch on Hopper or newer with a
    Triton that has it, unless ``EAGLE_CAPTURE_PDL=0`` (``wrap_triton``, used by
    the registered ops, has no PDL launch option)."""
    if not HAS_PDL or os.environ.get("EAGLE_CAPTURE_PDL", "1") == "0":
        return False
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9
