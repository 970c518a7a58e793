"""Tensor-parallel capture: reduce first, then add, then store -- by construction.

At the capture point the hidden axis is never sharded (docs/engine_facts.md section 3),
but the value arriving there is a *row-parallel partial sum* (each rank's
share of layer i-1's output projection) until it is all-reduced. SGLang up to
0.5.13 captured ``hidden_states + residual`` from such per-rank partials when
the all-reduce was deferred into the next layer's norm, and the draft's
quality dropped silently. Here the buffer of a :class:`TPCapture` is written
only by methods that take the *unreduced* partial and reduce it themselves
(or take the output of a kernel that reduced it), so a partial sum cannot
reach the buffer through this API.

* :meth:`TPCapture.reduce_add_rmsnorm` -- all-reduce the partial over the TP
  group, then the fused add+RMSNorm (+ capture at captured layers).
* :meth:`TPCapture.store_fused_allreduce_residual` -- SGLang's own fused
  all-reduce + add + RMSNorm (FlashInfer ``trtllm_allreduce_fusion``) hands
  back a fresh, reduced ``residual_out``; storing it into the slot keeps that
  fusion (TensorRT-LLM disables its fusion at captured layers instead).
* :meth:`TPCapture.add_rmsnorm_gather` -- token-scattered rows (all-to-all MoE
  backends): the local add+RMSNorm on this rank's block of rows, then an
  all-gather of the new residual rows over the *attention-TP* group (not the
  whole TP group: SGLang 0.5.9's bug) into the slot, in rank order = SGLang's
  row order. Rows past ``num_tokens`` (the padding that makes the token count
  divisible by the group size) are dropped: the buffer holds exactly T rows.

:func:`check_capture_consistency` is the opt-in debug check: all ranks of the
group must hold bit-identical captures of the model's full hidden size.
"""

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from eagle_capture import ops
from eagle_capture.buffer import AuxCaptureBuffer


class CaptureConsistencyError(RuntimeError):
    """Captured hidden states differ across ranks, or have the wrong width."""


class TPCapture:
    """An :class:`AuxCaptureBuffer` written only through reducing entry points."""

    def __init__(
        self,
        buffer: AuxCaptureBuffer,
        group: Optional[dist.ProcessGroup] = None,
        attn_tp_group: Optional[dist.ProcessGroup] = None,
        fused_allreduce=None,
    ) -> None:
        """``fused_allreduce``: an :class:`eagle_capture.parallel.symm.SymmAllReduceCapture`
        over ``group``; :meth:`reduce_add_rmsnorm` then runs all-reduce + add +
        RMSNorm + capture as one kernel for the T its path table gives the
        one-shot path (NCCL + the fused op otherwise)."""
        self.buffer = buffer
        self.group = group
        self.attn_tp_group = attn_tp_group if attn_tp_group is not None else group
        self.fused_allreduce = fused_allreduce

    def reduce_add_rmsnorm(
        self,
        layer_id: int,
        partial_hidden: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> None:
        """Layer ``layer_id``'s input boundary: ``partial_hidden`` (this rank's
        row-parallel share of layer ``layer_id - 1``'s output) is all-reduced in
        place, then ``residual += hidden; hidden = rmsnorm(residual) * w`` with the
        new residual also stored in the slot when ``layer_id`` is captured."""
        if self.fused_allreduce is not None:
            captured = self.buffer.captures_layer(layer_id)
            self.fused_allreduce.reduce_add_rmsnorm(
                partial_hidden,
                residual,
                weight,
                eps,
                self.buffer.aux if captured else None,
                self.buffer.slot_of(layer_id) if captured else 0,
            )
            return
        dist.all_reduce(partial_hidden, group=self.group)
        if self.buffer.captures_layer(layer_id):
            self.buffer.add_rmsnorm_capture(layer_id, partial_hidden, residual, weight, eps)
        else:
            ops.add_rmsnorm_capture(partial_hidden, residual, weight, eps)

    def store_fused_allreduce_residual(self, layer_id: int, residual_out: torch.Tensor) -> None:
        """Store the reduced ``residual_out`` of SGLang's fused all-reduce + add +
        RMSNorm into the slot (one read + one write; the fusion itself is kept)."""
        self.buffer.capture(layer_id, residual_out, None)

    def add_rmsnorm_gather(
        self,
        layer_id: int,
        hidden_local: torch.Tensor,
        residual_local: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        num_tokens: int,
    ) -> None:
        """Token-scattered rows: local add+RMSNorm on this rank's rows, then the new
        residual rows of every attention-TP rank gathered into the slot."""
        ops.add_rmsnorm_capture(hidden_local, residual_local, weight, eps)
        if not self.buffer.captures_layer(layer_id):
            return
        world = dist.get_world_size(self.attn_tp_group)
        rows = residual_local.shape[0]
        if rows * world < num_tokens:
            raise ValueError(
                f"eagle_capture: {world} ranks x {rows} local rows cannot hold "
                f"{num_tokens} tokens; is the gather over the attention-TP group?"
            )
        gathered = residual_local.new_empty(rows * world, residual_local.shape[1])
        dist.all_gather(
            list(gathered.split(rows)), residual_local.contiguous(), group=self.attn_tp_group
        )
        self.buffer.capture(layer_id, gathered[:num_tokens], None)


def _fingerprint(x: torch.Tensor) -> torch.Tensor:
    """Two exact int64 checksums of a capture's bits: their sum, and a sum
    weighted by position (so swapped rows or columns also show)."""
    int_type = {2: torch.int16, 4: torch.int32}[x.element_size()]
    flat = x.view(int_type).to(torch.int64).flatten()  # a same-size dtype view keeps strides
    weights = torch.arange(flat.numel(), device=x.device, dtype=torch.int64)
    weights.remainder_(65521).add_(1)
    # int64 sums may wrap; the wrap is deterministic, so equal bits still give equal sums.
    return torch.stack([flat.sum(), (flat * weights).sum()])


def check_capture_consistency(
    buffer: AuxCaptureBuffer,
    num_tokens: int,
    hidden_size: int,
    group: Optional[dist.ProcessGroup] = None,
    layer_ids: Optional[Sequence[int]] = None,
) -> None:
    """Raise :class:`CaptureConsistencyError` unless every rank of ``group`` holds
    bit-identical captures of width ``hidden_size`` (the model's, not H / tp).

    Cost (counted from the code, not measured): per captured layer 8 kernel
    launches and ~90 bytes of device-memory traffic per captured element (the
    slot widened to int64, a position-weight vector, a product, two sums) --
    for T = 4096, H = 7168 about 2.6 GB, ~0.7 ms on an H200 -- then, for the
    whole buffer, one all-gather of ``2 * K`` int64 per rank and one host sync.
    A debug flag, not for every step.
    """
    if buffer.hidden_size != hidden_size:
        raise CaptureConsistencyError(
            f"captures are {buffer.hidden_size} wide but the model's hidden size is "
            f"{hidden_size}: a tensor-parallel shard (H / tp) reached the capture point; "
            f"capture only full, reduced hidden states"
        )
    layer_ids = list(layer_ids) if layer_ids is not None else list(buffer.layer_ids)
    local = torch.stack([_fingerprint(buffer.slot_view(layer, num_tokens)) for layer in layer_ids])
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    everyone = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(everyone, local, group=group)
    everyone = torch.stack(everyone).cpu()  # [world, K, 2]
    problems = []
    for k, layer in enumerate(layer_ids):
        prints = [tuple(everyone[r, k].tolist()) for r in range(world)]
        distinct = set(prints)
        if len(distinct) == 1:
            continue
        # Ranks grouped by the value they hold, largest group first.
        holders = sorted(
            ([r for r in range(world) if prints[r] == p] for p in distinct),
            key=lambda ranks: (-len(ranks), ranks),
        )
        votes = len(holders[0])
        if votes == 1 and world == 2:
            cause = (
                "the two ranks hold different values: an unreduced per-rank partial sum "
                "(reduce first, then add), or one rank diverging -- with two ranks "
                "which one cannot be told"
            )
            ranks = list(range(world))
        elif votes == 1:
            cause = (
                "every rank holds a different value: likely an unreduced per-rank partial "
                "sum was captured (reduce first, then add)"
            )
            ranks = list(range(world))
        elif len(holders[1]) == votes:  # no majority: name every group
            ranks = list(range(world))
            cause = (
                "the ranks split into groups holding different values: "
                + " vs ".join(str(group) for group in holders)
                + " -- a reduction or gather over a sub-group (e.g. the attention-TP "
                "group instead of the TP group), or groups fed different batches"
            )
        else:
            ranks = sorted(r for group in holders[1:] for r in group)
            cause = (
                f"rank(s) {ranks} diverge from the other {votes}: a stale or wrongly "
                f"indexed buffer, a rank that skipped the capture, or a missing gather"
            )
        problems.append(
            f"layer {layer} (slot {buffer.slot_of(layer)}): ranks {ranks} differ; {cause}"
        )
    if problems:
        raise CaptureConsistencyError(
            f"rank {rank}: captured hidden states are not consistent "
            f"across the {world} ranks:\n  " + "\n  ".join(problems)
        )
