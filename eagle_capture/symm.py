"""All-reduce fused with the next layer's add+RMSNorm and the capture store.

:class:`SymmAllReduceCapture` owns a symmetric-memory buffer (torch
``_symmetric_memory``) on every rank of a tensor-parallel group. At a layer
boundary, :meth:`~SymmAllReduceCapture.reduce_add_rmsnorm` takes this rank's
row-parallel *partial* hidden states and

* for ``T <= one_shot_max_tokens``: copies them into the symmetric buffer (or
  finds them already there: :meth:`input_buffer` lets the projection write
  straight into it) and launches the one-shot kernel
  (kernels/allreduce_add_rmsnorm_capture.py): every rank reads every rank's
  buffer over NVLink, sums, adds the residual, normalises and stores the
  capture -- one launch instead of all-reduce + add+RMSNorm;
* above it: NCCL all-reduce, then :func:`eagle_capture.add_rmsnorm_capture`.

The crossover must be measured on the machine (``benchmarks/allreduce_capture.py``
prints it); the default keeps the one-shot path for every T the buffer holds,
which is only right for decode sizes. It has not been measured: no machine
with more than one GPU was available when this was written.

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

import os
from typing import Optional

import torch
import torch.distributed as dist

from . import _checks, ops
from .kernels.add_rmsnorm_capture import MAX_HIDDEN_SIZE, launch_config
from .kernels.allreduce_add_rmsnorm_capture import oneshot_allreduce_add_rmsnorm_capture_kernel

_MULTICAST_OFF = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0",
                  "NVSHMEM_DISABLE_NVLS": "1"}


def check_multicast_disabled() -> None:
    """Raise unless every multicast-off variable holds its safe value (an unset
    one fails too: :func:`ensure_multicast_disabled` sets the defaults)."""
    for name, value in _MULTICAST_OFF.items():
        if os.environ.get(name) != value:
            raise RuntimeError(f"eagle_capture: {name}={os.environ.get(name)!r}; NVLink "
                               f"multicast must stay off on these hosts: set {name}={value}")


def ensure_multicast_disabled() -> None:
    """Set each multicast-off variable that is unset to its safe value, then
    :func:`check_multicast_disabled`: a value the user set to enable multicast
    is refused, never overridden. Run by :class:`SymmAllReduceCapture` before it
    allocates; call it before ``init_process_group`` for NCCL to see it too."""
    for name, value in _MULTICAST_OFF.items():
        os.environ.setdefault(name, value)
    check_multicast_disabled()


class SymmAllReduceCapture:
    """One-shot all-reduce + add + RMSNorm + capture for a TP group, NCCL above
    ``one_shot_max_tokens``.

    Collective: every rank of ``group`` must construct it (symmetric
    allocation and rendezvous) and call :meth:`reduce_add_rmsnorm` with the same
    T in the same order, as with any collective. Construction first runs
    :func:`ensure_multicast_disabled`.
    """

    def __init__(self, max_tokens: int, hidden_size: int, dtype: torch.dtype,
                 group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None,
                 one_shot_max_tokens: Optional[int] = None) -> None:
        ensure_multicast_disabled()  # before torch's symmetric memory is touched
        import torch.distributed._symmetric_memory as symm_mem

        if max_tokens < 1 or not 1 <= hidden_size <= MAX_HIDDEN_SIZE:
            raise ValueError(f"eagle_capture: max_tokens must be >= 1 and hidden_size in "
                             f"[1, {MAX_HIDDEN_SIZE}], got {max_tokens}, {hidden_size}")
        self.group = group if group is not None else dist.group.WORLD
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda", torch.cuda.current_device())
        self.max_tokens, self.hidden_size, self.dtype = max_tokens, hidden_size, dtype
        self.buffer = symm_mem.empty(max_tokens, hidden_size, dtype=dtype, device=self.device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group)
        self.rank, self.world_size = self.handle.rank, self.handle.world_size
        self._buffer_ptrs = torch.tensor(self.handle.buffer_ptrs, dtype=torch.int64,
                                         device=self.device)
        self._signal_pad_ptrs = torch.tensor(self.handle.signal_pad_ptrs, dtype=torch.int64,
                                             device=self.device)
        # Programs: one signal slot per (program, rank) in the pad, and at most one
        # per SM so that every program of every rank is resident at once (a
        # program spinning in the barrier must never wait for a peer program that
        # cannot start; see the kernel's docstring). All ranks must launch the
        # same grid: agree on the smallest bound in the group.
        pad_slots = symm_mem.get_signal_pad_size() // 4
        sm_count = torch.cuda.get_device_properties(self.device).multi_processor_count
        bound = torch.tensor([min(sm_count, pad_slots // self.world_size)], dtype=torch.int64,
                             device="cpu" if dist.get_backend(self.group) == "gloo"
                             else self.device)
        dist.all_reduce(bound, op=dist.ReduceOp.MIN, group=self.group)
        self.max_programs = max(1, int(bound.item()))
        self.one_shot_max_tokens = (max_tokens if one_shot_max_tokens is None
                                    else min(int(one_shot_max_tokens), max_tokens))
        self._block_h, self._num_warps, _ = launch_config(hidden_size, True)

    def input_buffer(self, num_tokens: int) -> torch.Tensor:
        """``[num_tokens, H]`` view of this rank's symmetric buffer: a projection
        that writes its partial output here saves the copy."""
        if not 0 <= num_tokens <= self.max_tokens:
            raise ValueError(f"eagle_capture: num_tokens must be in [0, {self.max_tokens}], "
                             f"got {num_tokens}")
        return self.buffer[:num_tokens]

    def overlaps_buffer(self, t: torch.Tensor) -> bool:
        """Whether ``t`` shares bytes with this rank's symmetric buffer (which the
        peers read during a one-shot call): :func:`eagle_capture._checks.ranges_overlap`."""
        return _checks.ranges_overlap(t, self.buffer)

    def reduce_add_rmsnorm(self, partial: torch.Tensor, residual: torch.Tensor,
                           weight: torch.Tensor, eps: float, aux: Optional[torch.Tensor] = None,
                           slot: int = 0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``h = all_reduce(partial)``; ``residual = h + residual`` (in place);
        ``aux[:T, slot] = residual`` when ``aux`` is given; returns
        ``rmsnorm(residual) * weight`` written into ``out`` (default: ``partial``,
        unless ``partial`` is this object's symmetric buffer, which peers may
        still be reading: then a new tensor)."""
        num_tokens = partial.shape[0] if partial.dim() == 2 else -1
        if partial.dim() != 2 or partial.shape[1] != self.hidden_size or \
                partial.dtype != self.dtype or partial.device != self.device:
            raise ValueError(f"eagle_capture: partial must be [T, {self.hidden_size}] "
                             f"{self.dtype} on {self.device}, got {tuple(partial.shape)} "
                             f"{partial.dtype} on {partial.device}")
        if torch.cuda.current_device() != self.device.index:
            raise ValueError(f"eagle_capture: this SymmAllReduceCapture lives on {self.device} "
                             f"but the current CUDA device is cuda:{torch.cuda.current_device()}")
        one_shot = num_tokens <= self.one_shot_max_tokens
        in_buffer = self.overlaps_buffer(partial)
        if out is None:
            out = torch.empty_like(partial) if in_buffer else partial
        # The kernel reads the peers' buffers as the residual's dtype: all must match.
        for name, t in (("out", out), ("residual", residual)):
            if not isinstance(t, torch.Tensor) or t.dtype != self.dtype or t.device != self.device:
                raise ValueError(f"eagle_capture: {name} must be a {self.dtype} tensor on "
                                 f"{self.device} (the symmetric buffer's dtype), got "
                                 f"{getattr(t, 'dtype', type(t))} on {getattr(t, 'device', '-')}")
        if self.overlaps_buffer(out) or self.overlaps_buffer(residual) or (
                aux is not None and self.overlaps_buffer(aux)):
            raise ValueError("eagle_capture: out, residual and aux must not lie in the "
                             "symmetric buffer (peers read it while this rank writes)")
        # The same contract as the single-GPU add_rmsnorm_capture, with `out` as the
        # normed output (named hidden_states in the messages, as there).
        _checks.check_add_inputs(out, residual)
        _checks.check_norm_inputs(out, weight, eps)
        _checks.check_no_internal_overlap("hidden_states", out)
        _checks.check_no_internal_overlap("residual", residual)
        if aux is not None:
            _checks.check_aux(aux, slot, out.shape[0], out.shape[1], out.dtype, out.device)
        _checks.check_aliasing(out, residual, aux, slot, weight=weight, residual_mutated=True,
                               hidden_mutated=True)
        if out.shape != partial.shape:
            raise ValueError(f"eagle_capture: out must have partial's shape "
                             f"{tuple(partial.shape)}, got {tuple(out.shape)}")
        if num_tokens == 0:
            return out
        if not one_shot:
            if in_buffer:
                raise ValueError(f"eagle_capture: T = {num_tokens} > one_shot_max_tokens = "
                                 f"{self.one_shot_max_tokens} takes the NCCL path, which "
                                 f"reduces in place: partial must not be the symmetric buffer")
            # Reduce into `out` (partial itself by default), as the one-shot path
            # leaves an explicit out's partial untouched; the collective needs a
            # dense tensor.
            reduced = out if out.is_contiguous() else torch.empty_like(
                out, memory_format=torch.contiguous_format)
            if reduced is not partial:
                reduced.copy_(partial)
            dist.all_reduce(reduced, group=self.group)
            if reduced is not out:
                out.copy_(reduced)
            ops.add_rmsnorm_capture(out, residual, weight, eps, aux, slot)
            return out
        staged = self.buffer[:num_tokens]
        if not (in_buffer and partial.data_ptr() == staged.data_ptr()
                and partial.is_contiguous()):
            if in_buffer:
                raise ValueError("eagle_capture: partial lies in the symmetric buffer but is "
                                 "not input_buffer(T)")
            staged.copy_(partial)
        grid = (min(num_tokens, self.max_programs),)
        oneshot_allreduce_add_rmsnorm_capture_kernel[grid](
            self._buffer_ptrs, self._signal_pad_ptrs, residual, weight, out, residual,
            aux if aux is not None else residual, num_tokens, self.hidden_size, float(eps),
            self.rank, residual.stride(0), out.stride(0), residual.stride(0),
            aux.stride(0) if aux is not None else 0,
            slot * aux.stride(1) if aux is not None else 0,
            WORLD_SIZE=self.world_size, CAPTURE=aux is not None, BLOCK_H=self._block_h,
            num_warps=self._num_warps)
        return out
