"""All-reduce fused with the next layer's add+RMSNorm and the capture store.

:class:`SymmAllReduceCapture` owns a symmetric-memory buffer (torch
``_symmetric_memory``) on every rank of a tensor-parallel group. At a layer
boundary, :meth:`~SymmAllReduceCapture.reduce_add_rmsnorm` takes this rank's
row-parallel *partial* hidden states and, by the path chosen for (world
size, T) by a :class:`PathTable`,

* ``one_shot``: one launch of the Lamport kernel
  (eagle_capture/kernels/allreduce_add_rmsnorm_capture.py): every rank pushes its partial
  into every rank's buffer over NVLink, polls its own buffer until the rows
  have arrived, sums, adds the residual, normalises and stores the capture.
  No barrier, no staging copy (the partial is read where it lies);
* ``nccl``: NCCL all-reduce, then :func:`eagle_capture.add_rmsnorm_capture`.

The path table is measured on the machine
(``torchrun --nproc-per-node W benchmarks/allreduce_capture.py --write-table F``)
and passed as ``table=F`` (or ``EAGLE_CAPTURE_ALLREDUCE_TABLE=F``); without one,
:data:`DEFAULT_ONE_SHOT_MAX_TOKENS` decides (benchmarks/RESULTS.md has the
measurements behind it).

Under ``torch.compile`` the one-shot path is the custom op
``torch.ops.eagle_capture.allreduce_add_rmsnorm_capture`` (fake implementation,
no graph break); eagerly the method launches the kernel through the eager fast
path of the single-GPU ops (:class:`eagle_capture.ops.launcher.FastLaunch`). Both are
CUDA-graph capturable: the kernel's epoch lives in device memory.

NVLink multicast stays off: on the shared hosts it can take GPUs out of
service. Constructing a :class:`SymmAllReduceCapture` sets
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NCCL_NVLS_ENABLE=0`` and
``NVSHMEM_DISABLE_NVLS=1`` where they are unset and refuses to run when one of
them is set to enable multicast (:func:`ensure_multicast_disabled`), before
any symmetric-memory allocation; the kernel uses no multimem instruction.
Importing the module leaves ``os.environ`` alone. NCCL reads its variable when
a communicator is created, which is usually before this object exists: set
them in the launcher's environment too, or call
:func:`ensure_multicast_disabled` before ``init_process_group``.
"""

import functools
import itertools
import os
import weakref
from typing import Optional

import torch
import torch.distributed as dist

from eagle_capture.kernels.add_rmsnorm_capture import MAX_HIDDEN_SIZE, launch_config
from eagle_capture.kernels.allreduce_add_rmsnorm_capture import (
    NUM_BUFFERS,
    STATE_INTS,
    lamport_allreduce_add_rmsnorm_capture_kernel,
)
from eagle_capture.ops import add_rmsnorm_capture
from eagle_capture.ops.checks import (
    SUPPORTED_DTYPES,
    byte_extent,
    check_add_inputs,
    check_aliasing,
    check_aux,
    check_no_autograd,
    check_no_internal_overlap,
    check_norm_inputs,
    overlaps_other_elements,
    ranges_overlap,
)
from eagle_capture.ops.launcher import FastLaunch, Plan, addresses

# The path table lives in its own module; re-exported here, where callers look.
from eagle_capture.parallel.paths import (  # noqa: F401
    DEFAULT_ONE_SHOT_MAX_TOKENS,
    PATHS,
    TABLE_ENV,
    TABLE_FORMAT,
    PathTable,
    default_one_shot_max_tokens,
)

_MULTICAST_OFF = {
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NCCL_NVLS_ENABLE": "0",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def check_multicast_disabled() -> None:
    """Raise unless every multicast-off variable holds its safe value (an unset
    one fails too: :func:`ensure_multicast_disabled` sets the defaults)."""
    for name, value in _MULTICAST_OFF.items():
        if os.environ.get(name) != value:
            raise RuntimeError(
                f"eagle_capture: {name}={os.environ.get(name)!r}; NVLink "
                f"multicast must stay off on these hosts: set {name}={value}"
            )


def ensure_multicast_disabled() -> None:
    """Set each multicast-off variable that is unset to its safe value, then
    :func:`check_multicast_disabled`: a value the user set to enable multicast
    is refused, never overridden. Run by :class:`SymmAllReduceCapture` before it
    allocates; call it before ``init_process_group`` for NCCL to see it too."""
    for name, value in _MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    check_multicast_disabled()


# Live objects by name: the custom op takes a name (as torch's symm_mem ops take
# a group name), since a Python object cannot be an op argument.
_INSTANCES: "weakref.WeakValueDictionary[str, SymmAllReduceCapture]" = weakref.WeakValueDictionary()
_NAMES = itertools.count()


class SymmAllReduceCapture:
    """All-reduce + add + RMSNorm + capture for a TP group: the one-shot kernel
    or NCCL + the fused op, per T.

    Collective: every rank of ``group`` must construct it (symmetric
    allocation and rendezvous) and call :meth:`reduce_add_rmsnorm` with the same
    T in the same order, as with any collective. Construction first runs
    :func:`ensure_multicast_disabled`.

    ``one_shot_max_tokens`` caps the one-shot path (and sizes its buffer:
    ``3 * W * rows * H`` elements per rank); ``table`` (a path, dict or
    :class:`PathTable`; default ``$EAGLE_CAPTURE_ALLREDUCE_TABLE``) picks the
    path per T below the cap. ``watchdog_s`` (opt-in): a poll that waits longer
    gives up and every later call raises, instead of a silent hang when a peer
    never arrives; results of the call that tripped it are garbage.
    ``rows_by_ticket`` (opt-in): programs take rows in the order they start (one
    atomic each) instead of by program id, so the kernel makes progress whatever
    order the GPU dispatches its programs in, also when only some of them fit
    beside other work (MPS limits, green contexts); by program id it relies on
    in-order dispatch (CUDA's practice, not its promise). Costs 0.3 - 0.5 us per
    call at T <= 64 on 2 H200s (benchmarks/NOTES.md).
    """

    def __init__(
        self,
        max_tokens: int,
        hidden_size: int,
        dtype: torch.dtype,
        group: Optional[dist.ProcessGroup] = None,
        device: Optional[torch.device] = None,
        one_shot_max_tokens: Optional[int] = None,
        table=None,
        watchdog_s: Optional[float] = None,
        rows_by_ticket: bool = False,
    ) -> None:
        ensure_multicast_disabled()  # before torch's symmetric memory is touched
        import torch.distributed._symmetric_memory as symm_mem

        if max_tokens < 1 or not 1 <= hidden_size <= MAX_HIDDEN_SIZE:
            raise ValueError(
                f"eagle_capture: max_tokens must be >= 1 and hidden_size in "
                f"[1, {MAX_HIDDEN_SIZE}], got {max_tokens}, {hidden_size}"
            )
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"eagle_capture: dtype must be bfloat16, float16 or float32, got {dtype}"
            )
        if watchdog_s is not None and not watchdog_s > 0:
            raise ValueError(f"eagle_capture: watchdog_s must be > 0 or None, got {watchdog_s}")
        table = table if table is not None else os.environ.get(TABLE_ENV) or None
        self.table = PathTable.load(table) if table is not None else None
        if self.table is not None and self.table.hidden_size not in (None, hidden_size):
            raise ValueError(
                f"eagle_capture: path table {self.table.source} was measured for "
                f"hidden_size {self.table.hidden_size}, not {hidden_size}"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.device = torch.device(device) if device is not None else torch.device("cuda")
        if self.device.index is None:  # "cuda": the current device, as tensors report it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_tokens, self.hidden_size, self.dtype = max_tokens, hidden_size, dtype
        self.world_size = dist.get_world_size(self.group)
        cap = (
            self._one_shot_limit_from_rule()
            if one_shot_max_tokens is None
            else int(one_shot_max_tokens)
        )
        self.one_shot_max_tokens = max(0, min(cap, max_tokens))
        rows = max(self.one_shot_max_tokens, 1)
        # [NUM_BUFFERS, W senders, rows, H], -0.0 everywhere ("not arrived").
        self.buffer = symm_mem.empty(
            NUM_BUFFERS * self.world_size * rows * hidden_size, dtype=dtype, device=self.device
        )
        self.buffer.fill_(-0.0)
        self.handle = symm_mem.rendezvous(self.buffer, self.group)
        self.rank = self.handle.rank
        self._rows = rows
        self.state = torch.zeros(STATE_INTS, dtype=torch.int32, device=self.device)
        # The watchdog flag: pinned host memory the kernel writes through its
        # device address (unified addressing), so the host reads it without a sync.
        self._watchdog_flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self._timeout_ns = int(watchdog_s * 1e9) if watchdog_s is not None else 0
        self.rows_by_ticket = bool(rows_by_ticket)
        self._ptr_table = torch.tensor(
            list(self.handle.buffer_ptrs) + [self._watchdog_flag.data_ptr()],
            dtype=torch.int64,
            device=self.device,
        )
        # At most one program per SM (all co-resident on an idle GPU, see the
        # kernel's docstring); every rank must launch the same grid.
        sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        bound = torch.tensor(
            [sm_count],
            dtype=torch.int64,
            device="cpu" if dist.get_backend(self.group) == "gloo" else self.device,
        )
        dist.all_reduce(bound, op=dist.ReduceOp.MIN, group=self.group)
        self.max_programs = max(1, int(bound.item()))
        self._block_h, self._num_warps, _ = launch_config(hidden_size, True, allreduce=True)
        # Every rank's buffer holds -0.0 before any peer may push into it.
        torch.cuda.synchronize(self.device)
        dist.barrier(group=self.group)
        # The eager fast path (the single-GPU ops' own): validated call signatures.
        self._launcher = FastLaunch(lamport_allreduce_add_rmsnorm_capture_kernel)
        self._buffer_addr = self.buffer.data_ptr()
        self._buffer_bytes = self.buffer.numel() * self.buffer.element_size()
        self.name = f"symm{next(_NAMES)}"
        _INSTANCES[self.name] = self

    def _one_shot_limit_from_rule(self) -> int:
        if self.table is not None and self.world_size in self.table.paths:
            one_shot = [t for t, p in self.table.paths[self.world_size] if p == "one_shot"]
            return max(one_shot, default=0)
        return default_one_shot_max_tokens(self.world_size)

    def path_for(self, num_tokens: int) -> str:
        """``"one_shot"`` or ``"nccl"`` for a call with ``num_tokens`` rows."""
        if num_tokens > self.one_shot_max_tokens:
            return "nccl"
        if self.table is not None:
            chosen = self.table.path(self.world_size, num_tokens)
            if chosen is not None:
                return "one_shot" if chosen == "one_shot" else "nccl"  # no engine here
        return "one_shot"

    def overlaps_buffer(self, t: torch.Tensor) -> bool:
        """Whether ``t`` shares bytes with this rank's symmetric buffer (which the
        peers write during a one-shot call): :func:`eagle_capture.ops.checks.ranges_overlap`."""
        return ranges_overlap(t, self.buffer)

    def watchdog_tripped(self) -> bool:
        """Whether a poll gave up waiting (host read of pinned memory, no sync)."""
        return bool(self._watchdog_flag.item())

    def _check_watchdog(self) -> None:
        if self._timeout_ns and self.watchdog_tripped():
            raise RuntimeError(
                f"eagle_capture: rank {self.rank}: a one-shot all-reduce waited more than "
                f"{self._timeout_ns / 1e9:g} s for a peer's rows and gave up (a rank that never "
                f"arrived, or programs that could not all be resident). The results of that "
                f"call are garbage and this SymmAllReduceCapture can no longer be used"
            )

    def _validate(
        self, partial, residual, weight, eps, aux, slot, out, norm_fp32_sum=False
    ) -> None:
        if (
            not isinstance(partial, torch.Tensor)
            or partial.dim() != 2
            or partial.shape[1] != self.hidden_size
            or partial.dtype != self.dtype
            or partial.device != self.device
            or partial.stride(1) != 1
        ):
            raise ValueError(
                f"eagle_capture: partial must be a row-major [T, {self.hidden_size}] "
                f"{self.dtype} tensor on {self.device}, got "
                f"{getattr(partial, 'shape', type(partial))} "
                f"{getattr(partial, 'dtype', '')} on {getattr(partial, 'device', '-')}"
            )
        if torch.cuda.current_device() != self.device.index:
            raise ValueError(
                f"eagle_capture: this SymmAllReduceCapture lives on {self.device} "
                f"but the current CUDA device is cuda:{torch.cuda.current_device()}"
            )
        # The kernel writes the buffer's dtype into residual, out and aux.
        for name, t in (("out", out), ("residual", residual)):
            if not isinstance(t, torch.Tensor) or t.dtype != self.dtype or t.device != self.device:
                raise ValueError(
                    f"eagle_capture: {name} must be a {self.dtype} tensor on "
                    f"{self.device} (the symmetric buffer's dtype), got "
                    f"{getattr(t, 'dtype', type(t))} on {getattr(t, 'device', '-')}"
                )
        if out.shape != partial.shape:
            raise ValueError(
                f"eagle_capture: out must have partial's shape "
                f"{tuple(partial.shape)}, got {tuple(out.shape)}"
            )
        # The same contract as the single-GPU add_rmsnorm_capture, with `out` as the
        # normed output (named hidden_states in the messages, as there).
        check_add_inputs(out, residual)
        check_norm_inputs(out, weight, eps)
        if aux is not None:
            check_aux(aux, slot, out.shape[0], out.shape[1], out.dtype, out.device)
        if torch.compiler.is_compiling():
            return  # address checks need real tensors; eager calls made them
        for name, t in (("partial", partial), ("out", out), ("residual", residual), ("aux", aux)):
            if t is not None and self.overlaps_buffer(t):
                raise ValueError(
                    f"eagle_capture: {name} must not lie in the symmetric buffer "
                    f"(peers write into it during a one-shot call)"
                )
        check_no_internal_overlap("hidden_states", out)
        check_no_internal_overlap("residual", residual)
        check_aliasing(
            out, residual, aux, slot, weight=weight, residual_mutated=True, hidden_mutated=True
        )
        # Into partial's own rows is fine: each row is pushed by the program that
        # later overwrites it.
        if out is not partial and overlaps_other_elements(out, partial):
            raise ValueError(
                "eagle_capture: out must be partial itself (or a view of the "
                "same rows) or not overlap it"
            )
        if ranges_overlap(partial, residual) or (aux is not None and ranges_overlap(partial, aux)):
            raise ValueError(
                "eagle_capture: partial must not overlap residual or aux "
                "(both are written while peers' rows are still arriving)"
            )

    def reduce_add_rmsnorm(
        self,
        partial: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        aux: Optional[torch.Tensor] = None,
        slot: int = 0,
        out: Optional[torch.Tensor] = None,
        norm_fp32_sum: bool = False,
    ) -> torch.Tensor:
        """``h = all_reduce(partial)``; ``residual = h + residual`` (in place);
        ``aux[:T, slot] = residual`` when ``aux`` is given; returns
        ``rmsnorm(residual) * weight`` written into ``out`` (default: ``partial``).
        ``norm_fp32_sum`` as in :func:`eagle_capture.add_rmsnorm_capture`.

        Eager calls validate once per call signature (shapes, strides, dtypes,
        slot, eps, flags: no addresses) and then launch the compiled kernel
        directly, as the single-GPU ops do; per call only the arguments' byte
        ranges are compared (with each other and the symmetric buffer), and an
        overlap gets the full check."""
        if self._timeout_ns:
            self._check_watchdog()
        out = partial if out is None else out
        if torch.is_grad_enabled():  # every call: requires_grad is not in the memo key
            check_no_autograd(
                "SymmAllReduceCapture.reduce_add_rmsnorm", (partial, residual, weight, out, aux)
            )
        if torch.compiler.is_compiling():
            self._validate(partial, residual, weight, eps, aux, slot, out)
            if partial.shape[0] == 0:
                return out
            if self.path_for(partial.shape[0]) == "nccl":
                return self._nccl_path(
                    partial, residual, weight, eps, aux, slot, out, norm_fp32_sum
                )
            # The op takes out=None for "into partial": one tensor passed as two
            # arguments, one of them mutated, is an aliasing error for a custom op.
            torch.ops.eagle_capture.allreduce_add_rmsnorm_capture(
                partial,
                residual,
                weight,
                eps,
                aux,
                slot,
                None if out is partial else out,
                self.state,
                self.name,
                norm_fp32_sum,
            )
            return out
        key = self._signature(partial, residual, weight, eps, aux, slot, out, norm_fp32_sum)
        tensors = (partial, residual, weight, out, aux)
        # An overlap among the arguments or with the symmetric buffer gets the full
        # check, which raises or allows it (a residual from another slot).
        plan, ptrs = self._launcher.eager_plan(
            key,
            tensors,
            (partial, residual, weight, eps, aux, slot, out, norm_fp32_sum),
            self._validate,
            self._validate,
            self._eager_plan,
        )
        if partial.shape[0] == 0:
            return out
        if plan.extra == "nccl":
            return self._nccl_path(partial, residual, weight, eps, aux, slot, out, norm_fp32_sum)
        self._launcher.launch(plan, tensors, ptrs)
        return out

    def _signature(self, partial, residual, weight, eps, aux, slot, out, norm_fp32_sum):
        """The memo key: everything the checks and the launch depend on but
        addresses (spelled out: a generator over the tensors costs ~2 us more)."""
        try:
            return (
                partial.shape,
                partial.stride(),
                partial.dtype,
                partial.device,
                residual.shape,
                residual.stride(),
                residual.dtype,
                residual.device,
                weight.shape,
                weight.stride(),
                weight.dtype,
                weight.device,
                None if out is partial else (out.shape, out.stride(), out.dtype, out.device),
                None if aux is None else (aux.shape, aux.stride(), aux.dtype, aux.device),
                type(slot),
                slot,
                type(eps),
                eps,
                bool(norm_fp32_sum),
                torch.cuda.current_device(),
            )
        except AttributeError:  # a non-tensor argument: the full check names it
            return None

    def _nccl_path(self, partial, residual, weight, eps, aux, slot, out, norm_fp32_sum):
        # Reduce into `out` (partial itself by default); the collective needs a
        # dense tensor.
        reduced = (
            out
            if out.is_contiguous()
            else torch.empty_like(out, memory_format=torch.contiguous_format)
        )
        if reduced is not partial:
            reduced.copy_(partial)
        dist.all_reduce(reduced, group=self.group)
        if reduced is not out:
            out.copy_(reduced)
        add_rmsnorm_capture(out, residual, weight, eps, aux, slot, norm_fp32_sum)
        return out

    def _plan(
        self,
        partial,
        residual,
        weight,
        eps,
        aux,
        slot,
        out,
        state,
        norm_fp32_sum,
        debug_spin: int = 0,
        debug_rank: int = -1,
    ) -> Plan:
        """The launch of a call signature (``extra``: its path). The call's five
        tensors (partial, residual, weight, out, aux) lead the kernel's
        arguments; the symmetric-buffer table and the state are this object's.
        Its byte ranges: the five tensors' (out's none when it is partial: the
        key tells) and this rank's symmetric buffer, which the peers write."""
        num_tokens = partial.shape[0]
        values = dict(
            ptr_table=self._ptr_table,
            state_ptr=state,
            num_tokens=num_tokens,
            hidden_size=self.hidden_size,
            max_tokens=self._rows,
            eps=float(eps),
            rank=self.rank,
            stride_partial=partial.stride(0),
            stride_residual=residual.stride(0),
            stride_normed_out=out.stride(0),
            stride_residual_out=residual.stride(0),
            stride_aux_row=aux.stride(0) if aux is not None else 0,
            aux_slot_offset=slot * aux.stride(1) if aux is not None else 0,
            timeout_ns=self._timeout_ns,
            debug_rank=debug_rank,
            WORLD_SIZE=self.world_size,
            CAPTURE=aux is not None,
            NORM_FP32_SUM=bool(norm_fp32_sum),
            USE_GLOBALTIMER=True,
            DEBUG_SPIN=int(debug_spin),
            BLOCK_H=self._block_h,
            ROWS_BY_TICKET=self.rows_by_ticket,
            DEBUG_REVERSE_DISPATCH=False,
        )
        sources = dict(
            partial_ptr=0,
            residual_ptr=1,
            weight_ptr=2,
            normed_out_ptr=3,
            residual_out_ptr=1,
            aux_ptr=4 if aux is not None else 1,
        )
        extents = tuple(
            byte_extent(t)
            for t in (partial, residual, weight, None if out is partial else out, aux)
        )
        return self._launcher.plan(
            (min(num_tokens, self.max_programs), 1),
            values,
            sources,
            self._num_warps,
            self.device.index,
            False,
            extents,
            extra=self.path_for(num_tokens),
            fixed=((self._buffer_addr, self._buffer_bytes),),
        )

    def _eager_plan(self, partial, residual, weight, eps, aux, slot, out, norm_fp32_sum) -> Plan:
        return self._plan(partial, residual, weight, eps, aux, slot, out, self.state, norm_fp32_sum)

    def _launch_one_shot(
        self, partial, residual, weight, eps, aux, slot, out, state, norm_fp32_sum, **debug
    ) -> None:
        """The one-shot kernel on validated arguments (the custom op's body; tests
        pass ``debug_spin`` / ``debug_rank``), memoised as the eager calls are."""
        key = (
            None
            if debug
            else (
                "op",
                state.data_ptr(),
                self._signature(partial, residual, weight, eps, aux, slot, out, norm_fp32_sum),
            )
        )
        plan = self._launcher.memoised(
            key,
            (partial, residual, weight, eps, aux, slot, out, state, norm_fp32_sum),
            functools.partial(self._plan, **debug) if debug else self._plan,
        )
        tensors = (partial, residual, weight, out, aux)
        self._launcher.launch(plan, tensors, addresses(tensors))


@torch.library.custom_op(
    "eagle_capture::allreduce_add_rmsnorm_capture",
    mutates_args=("partial", "residual", "aux", "out", "state"),
    device_types="cuda",
)
def _allreduce_add_rmsnorm_capture_op(
    partial: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    aux: Optional[torch.Tensor],
    slot: int,
    out: Optional[torch.Tensor],
    state: torch.Tensor,
    name: str,
    norm_fp32_sum: bool,
) -> None:
    """The one-shot path of :meth:`SymmAllReduceCapture.reduce_add_rmsnorm` as an
    op: ``name`` is the object's :attr:`~SymmAllReduceCapture.name`, ``state``
    its device-side epoch (declared mutated, so calls keep their order); the
    normed output goes to ``out``, or into ``partial`` when ``out`` is None
    (``partial`` is declared mutated for that case)."""
    ar = _INSTANCES.get(name)
    if ar is None:
        raise ValueError(f"eagle_capture: no live SymmAllReduceCapture named {name!r}")
    ar._launch_one_shot(
        partial,
        residual,
        weight,
        eps,
        aux,
        slot,
        partial if out is None else out,
        state,
        norm_fp32_sum,
    )


@_allreduce_add_rmsnorm_capture_op.register_fake
def _(partial, residual, weight, eps, aux, slot, out, state, name, norm_fp32_sum) -> None:
    return None
