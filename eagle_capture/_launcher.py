"""Low-overhead eager launches of a compiled Triton kernel.

``kernel[grid](...)`` re-binds and re-specialises every argument on every
call (~19 us of host time per launch on the H200 machine's CPU,
benchmarks/NOTES.md); the layer loop calls the capture ops once per layer, so in eager
prefill that is paid K times a step. This launcher lets Triton compile and
launch the first call for a given *specialisation key* the normal way, keeps
the ``CompiledKernel`` it returns, and later calls its launcher directly.

Correctness rests on the key: it must determine Triton's specialisation of
every argument. Triton specialises a pointer on its dtype and on 16-byte
alignment, and an int on its value being 1, divisible by 16, or needing 64
bits; floats are not specialised. The key therefore holds the device, the
pointer dtypes, the int arguments' *values* (a superset of what Triton looks
at; there are few distinct ones per model) and the constexprs, and only
all-aligned launches use it. Anything not covered -- unaligned pointers, a
Triton outside 3.x or without ``triton.knobs`` (where the launch hooks live;
read on 3.6 and 3.9, run on 3.6; a later 3.x is assumed to keep the launcher
call), launch hooks installed by a profiler -- takes the normal path. Triton
debug or instrumentation settings changed after the first launch of a key are
not picked up by the cached kernel.

The cached form is a :class:`DirectLaunch`: on Triton 3.6 the C ``launch``
function itself (its Python ``__call__`` only forwards), elsewhere the
launcher object. The eager ops keep it in their memo entry and pass integer
device addresses, which the C launcher takes as they are (for a tensor it
calls ``data_ptr()`` and checks the pointer, per argument).

:class:`KernelSignature` binds a kernel's arguments by parameter name: the ops
and the all-reduce object give every argument by name and get the positional
list (or a per-call template over addresses) from it, so no caller knows a
position and a new kernel parameter breaks loudly (TypeError) in one place.

Measured on the H200 machine (Triton 3.6, T = 1; benchmarks/NOTES.md):
Triton's entry point 18.7 us per launch, its raw launcher 6.5 us with tensors
and 5.5 us with integer addresses, torch.add 6.2 us.
"""

import inspect
import operator
from typing import Any, Callable, Mapping, NamedTuple, Optional, Sequence

import torch
import triton

try:  # Triton >= 3.4 keeps the launch hooks in knobs
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older Triton
    _knobs = None


def _triton_release() -> Optional[tuple[int, int]]:
    try:
        major, minor = (int(p) for p in triton.__version__.split(".")[:2])
    except ValueError:
        return None
    return major, minor


def _direct_launch_supported() -> bool:
    # CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata,
    # launch_metadata, enter_hook, exit_hook, *all_args) is the launcher call
    # of Triton 3.3 .. 3.x (read from triton/runtime/jit.py of 3.3 - 3.9).
    release = _triton_release()
    return release is not None and release[0] == 3 and release[1] >= 3 and _knobs is not None


def _hook_active(hook) -> bool:
    # Triton 3.6+ keeps launch hooks in an always-present HookChain; it is
    # active only when something (a profiler such as proton) added a call.
    return hook is not None and bool(getattr(hook, "calls", True))


def hooks_active() -> bool:
    """True while a profiler has launch hooks installed: launches must then go
    through Triton's own entry point so the profiler sees them."""
    return (_hook_active(_knobs.runtime.launch_enter_hook)
            or _hook_active(_knobs.runtime.launch_exit_hook))


class KernelSignature:
    """A ``triton.jit`` kernel's parameters, by name: the one place that turns
    a call's arguments -- given by parameter name -- into the positional list
    that Triton's launchers take. Callers never know a position: Triton's own
    entry point takes keywords, and the direct launches get their argument list
    from :meth:`bind` or a :meth:`template`."""

    def __init__(self, kernel) -> None:
        parameters = inspect.signature(getattr(kernel, "fn", kernel)).parameters
        self.params = tuple(parameters)
        self.defaults = {name: p.default for name, p in parameters.items()
                         if p.default is not inspect.Parameter.empty}
        self._in_order = operator.itemgetter(*self.params)

    def bind(self, values: Mapping[str, Any]) -> tuple:
        """``values`` in the kernel's parameter order, defaults filled in;
        TypeError naming unknown and missing parameters."""
        if len(values) == len(self.params):
            try:
                return self._in_order(values)   # every parameter given (the launches here)
            except KeyError:
                pass
        unknown = sorted(values.keys() - set(self.params))
        missing = [p for p in self.params if p not in values and p not in self.defaults]
        if unknown or missing:
            raise TypeError(f"eagle_capture: kernel arguments do not match the kernel's "
                            f"signature (unknown {unknown}, missing {missing})")
        return self._in_order({**self.defaults, **values})

    def template(self, sources: Mapping[str, int],
                 values: Mapping[str, Any]) -> tuple[Callable[[Sequence], tuple], tuple]:
        """``(head, tail)`` such that ``(*head(pointers), *tail)`` is the bound
        argument list of a call whose pointer parameters take ``pointers[sources[p]]``
        (a sequence of tensors or addresses) and every other parameter its
        ``values`` entry: the eager fast paths' per-call argument list, built
        from addresses with no name lookup. When the pointer parameters lead the
        signature, head just picks them and tail is the rest."""
        bound = dict(zip(self.params, self.bind({**values, **{p: None for p in sources}})))
        fixed = [p for p in self.params if p not in sources]
        lead = self.params[:len(self.params) - len(fixed)]
        if all(p in sources for p in lead):
            return tuple_getter(sources[p] for p in lead), tuple(bound[p] for p in fixed)
        width = max(sources.values()) + 1
        where = dict(sources)
        where.update((p, width + i) for i, p in enumerate(fixed))
        gather = operator.itemgetter(*(where[p] for p in self.params))
        rest = [bound[p] for p in fixed]

        def head(pointers):
            if len(pointers) < width:  # the fixed values would shift into pointer places
                raise ValueError(f"eagle_capture: {len(pointers)} pointers for a template "
                                 f"that reads {width}")
            return gather([*pointers[:width], *rest])

        return head, ()


def tuple_getter(indices) -> Callable[[Sequence], tuple]:
    """A tuple of the items at ``indices`` (a tuple even for one index)."""
    indices = tuple(indices)
    if len(indices) == 1:
        (i,) = indices
        return lambda items: (items[i],)
    return operator.itemgetter(*indices)


class DirectLaunch(NamedTuple):
    """``launch(gx, gy, gz, stream, *mid, *kernel_args)`` launches one compiled
    kernel; kernel pointer arguments may be passed as ints (device addresses)."""
    launch: Callable
    mid: tuple
    compiled: Any = None  # keeps the CompiledKernel (and its loaded module) alive


# Triton 3.6's CudaLauncher.__call__(gridX, gridY, gridZ, stream, function, *args)
# only allocates scratch (none when both sizes are 0) and forwards to its C launch
# as ``self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid,
# self.launch_pdl, global_scratch, profile_scratch, *args)`` (read from 3.6.0's
# triton/backends/nvidia/driver.py); calling that directly saves a Python frame and
# two closures per launch (~1.5 us on the H200 host). That forwarding is known only
# for the releases listed here -- an earlier driver.py has the same call signature
# but forwards no PDL flag and no profile scratch; 3.9's call names the launch
# metadata -- so it is used only on them, for a launcher object of that call
# signature with a ``launch``, both launch flags and no scratch; everything else
# calls the CompiledKernel's ``run`` in the form Triton's own JITFunction.run uses.
_RAW_FORWARDING_RELEASES = frozenset({(3, 6)})
_RAW_FORWARDING = _triton_release() in _RAW_FORWARDING_RELEASES
_RAW_FORWARDING_CALL = ("self", "gridX", "gridY", "gridZ", "stream", "function", "args")


def _forwards_to_raw_launch(run) -> bool:
    """Whether ``run`` (a CompiledKernel's launcher) has the known forwarding
    form: a release listed above, its class's call signature, a callable
    ``launch``, the two launch flags, and no scratch to allocate. Structural:
    no source is read."""
    if not _RAW_FORWARDING:
        return False
    try:
        params = inspect.signature(type(run).__call__).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return (tuple(params) == _RAW_FORWARDING_CALL
            and params["args"].kind is inspect.Parameter.VAR_POSITIONAL
            and callable(getattr(run, "launch", None))
            and hasattr(run, "launch_cooperative_grid") and hasattr(run, "launch_pdl")
            and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0)


def direct_launch_of(compiled) -> DirectLaunch:
    run = compiled.run
    if _forwards_to_raw_launch(run):
        return DirectLaunch(run.launch, (compiled.function, run.launch_cooperative_grid,
                                         run.launch_pdl, None, None, compiled.packed_metadata,
                                         None, None, None), compiled)
    # CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata, launch_metadata,
    # enter_hook, exit_hook, *args): JITFunction.run's own call (Triton 3.3 - 3.9).
    return DirectLaunch(run, (compiled.function, compiled.packed_metadata, None, None, None),
                        compiled)


class CachedLauncher:
    """Launch a ``triton.jit`` function, bypassing JITFunction.run after the
    first call of each specialisation key.

    Only launches whose pointers are all 16-byte aligned (the normal case:
    the caching allocator aligns every block) take the direct path, so the
    key need not carry per-pointer alignment; any other launch goes through
    Triton's own entry point, which specialises it correctly.
    """

    MAX_ENTRIES = 1024  # distinct (shape, stride) combinations kept

    def __init__(self, jit_fn) -> None:
        self._fn = jit_fn
        self._compiled: dict[Any, Any] = {}
        self.direct = _direct_launch_supported()

    def __call__(self, grid: tuple[int, int], args: Sequence[Any], key: Any, num_warps: int,
                 device_index: int, aligned: bool,
                 launch_pdl: bool = False) -> Optional[DirectLaunch]:
        """Launch; return the key's DirectLaunch when one is cached (the caller
        may keep it and launch with it while its own memo key implies ``key``),
        else None."""
        kwargs = {"num_warps": num_warps}
        if launch_pdl:
            kwargs["launch_pdl"] = True
        if not (self.direct and aligned) or hooks_active():
            self._fn[grid](*args, **kwargs)
            return None
        direct = self._compiled.get(key)
        if direct is None:
            compiled = self._fn[grid](*args, **kwargs)
            if compiled is not None and not hasattr(compiled, "result"):  # not an async future
                if len(self._compiled) >= self.MAX_ENTRIES:
                    self._compiled.clear()
                self._compiled[key] = direct_launch_of(compiled)
            return None
        stream = torch._C._cuda_getCurrentRawStream(device_index)
        direct.launch(grid[0], grid[1], 1, stream, *direct.mid, *args)
        return direct
