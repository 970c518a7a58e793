"""The all-reduce at a captured layer's input norm, where SGLang fuses it.

At TP > 1 SGLang defers the all-reduce of a layer's MLP / MoE output into the
next layer's input norm: ``forward_with_allreduce_fusion`` (FlashInfer's
all-reduce + residual + RMSNorm, ``T <= 2048``, sm90 / sm100). At a captured
layer the drop-in then has three ways to produce the reduced residual, the
normed output and the capture; :class:`CapturedLayerAllReduce` picks one per
forward size T (``EAGLE_CAPTURE_FUSED_ALLREDUCE=1``; off by default: always
``engine_fusion``):

* ``one_shot``: the project's one kernel
  (:class:`eagle_capture.parallel.symm.SymmAllReduceCapture` on SGLang's TP
  group): all-reduce + add + RMSNorm + capture store in one launch;
* ``nccl``: SGLang's own all-reduce of the TP group (its custom all-reduce,
  NCCL, or gloo on CPU), then the fused add + RMSNorm + capture;
* ``engine_fusion``: SGLang's fusion, then the capture copied from its
  reduced ``residual_out`` (what the drop-in does when the switch is off).

Which: a measured :class:`eagle_capture.parallel.paths.PathTable`
(``EAGLE_CAPTURE_ALLREDUCE_TABLE``) for the world size; without one, one_shot
up to the default cap and engine_fusion above it (the one-shot rows are the
measured ones). A one_shot row where the kernel cannot run (no CUDA symmetric
memory: CPU) takes nccl.

Never the unreduced value: SGLang <= 0.5.20 runs the norm on the per-rank
partial when FlashInfer declines a call (``layernorm.py``); at captured layers
the drop-in reduces first there (:func:`fallback_all_reduce`), whatever the
switch says.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Optional

import torch

from eagle_capture.parallel.paths import TABLE_ENV, PathTable, default_one_shot_max_tokens

ONE_SHOT, NCCL, ENGINE_FUSION = "one_shot", "nccl", "engine_fusion"


class CapturedLayerAllReduce:
    """The path per T at captured layers, and the all-reduce each path uses.

    ``one_shot``: a :class:`SymmAllReduceCapture` over the TP group (None where
    it cannot run); ``reduce``: SGLang's all-reduce of the TP group
    (``GroupCoordinator.all_reduce``: returns the reduced tensor, in place or
    not). ``calls`` counts the eager calls per path (tests read it)."""

    def __init__(
        self,
        world_size: int,
        reduce,
        one_shot=None,
        table: Optional[PathTable] = None,
        dtype: Optional[torch.dtype] = None,
        hidden_size: Optional[int] = None,
    ) -> None:
        self.world_size, self.reduce, self.one_shot, self.table = (
            world_size,
            reduce,
            one_shot,
            table,
        )
        self.dtype, self.hidden_size = dtype, hidden_size
        self.calls: collections.Counter = collections.Counter()

    def measured_path(self, num_tokens: int) -> str:
        """The table's (or the default rule's) path, whether or not it can run here."""
        chosen = self.table.path(self.world_size, num_tokens) if self.table is not None else None
        if chosen is None:
            chosen = (
                ONE_SHOT
                if num_tokens <= default_one_shot_max_tokens(self.world_size)
                else ENGINE_FUSION
            )
        return chosen

    def path_for(self, num_tokens: int) -> str:
        chosen = self.measured_path(num_tokens)
        if chosen == ONE_SHOT and (
            self.one_shot is None or self.one_shot.path_for(num_tokens) != ONE_SHOT
        ):
            chosen = NCCL  # the kernel cannot run here, or T is above its buffer's rows
        return chosen

    def takes(self, x: torch.Tensor) -> bool:
        """Whether this call's tensors are the ones the paths were set up for
        (the same on every rank: no address or rank-local property)."""
        return (
            x.dtype == self.dtype
            and x.shape[-1] == self.hidden_size
            and (self.one_shot is None or x.device == self.one_shot.device)
        )

    def describe(self) -> str:
        sizes = (1, 8, 64, 256, 1024, 2048)
        where = ", ".join(f"T={t}: {self.path_for(t)}" for t in sizes)
        kernel = (
            "the one kernel on SGLang's TP group"
            if self.one_shot is not None
            else "no one-shot kernel here (its rows take SGLang's all-reduce + the fused op)"
        )
        source = self.table.source if self.table is not None else "the default rule"
        return f"captured layers' fused all-reduce: {kernel}; paths ({source}): {where}"


def build(
    max_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device, table=None
) -> tuple[Optional[CapturedLayerAllReduce], str]:
    """The captured layers' all-reduce for this SGLang process, or (None, why not).

    Collective on CUDA: every TP rank builds the one kernel's symmetric buffer
    here (the plugin calls it at the same point on every rank)."""
    from sglang.srt.distributed import parallel_state as ps

    tp = ps.get_tp_group()
    if tp.world_size <= 1:
        return None, "TP 1: there is no all-reduce to fuse"
    try:
        attn_tp, ep, moe_tp = (
            ps.get_attn_tp_group().world_size,
            ps.get_moe_ep_group().world_size,
            ps.get_moe_tp_group().world_size,
        )
    except Exception as e:  # noqa: BLE001
        return None, f"SGLang's process groups cannot be read ({e})"
    # SGLang fuses over the attention-TP group (post-attention norms) and the
    # MoE output's group (input norms): both must be the TP group's ranks for
    # one reduction over the TP group to be that sum.
    if attn_tp != tp.world_size:
        return None, (
            f"DP attention (attention-TP {attn_tp} of TP {tp.world_size}): the fused "
            f"reduction is not over the TP group"
        )
    if ep > 1 and moe_tp > 1:
        return None, (
            f"expert parallel {ep} x MoE-TP {moe_tp}: the MoE output's reduction "
            f"group is not the TP group"
        )
    table = table if table is not None else os.environ.get(TABLE_ENV) or None
    table = PathTable.load(table) if table is not None else None
    if table is not None and table.hidden_size not in (None, hidden_size):
        raise ValueError(
            f"eagle_capture: path table {table.source} was measured for "
            f"hidden_size {table.hidden_size}, not {hidden_size}"
        )
    one_shot = None
    if device.type == "cuda":
        from eagle_capture.parallel.symm import SymmAllReduceCapture

        probe = CapturedLayerAllReduce(tp.world_size, tp.all_reduce, None, table)
        rows = [t for t in range(1, max_tokens + 1) if probe.measured_path(t) == ONE_SHOT]
        if rows:  # some T takes the kernel: its buffer holds the largest
            one_shot = SymmAllReduceCapture(
                max(rows), hidden_size, dtype, group=tp.device_group, device=device, table=table
            )
    return CapturedLayerAllReduce(
        tp.world_size, tp.all_reduce, one_shot, table, dtype, hidden_size
    ), ""


def fallback_all_reduce(x: torch.Tensor, use_attn_tp_group: Optional[bool]) -> torch.Tensor:
    """``x`` all-reduced over the group SGLang's fusion would have reduced it
    over (its world-size rule in ``layernorm.py`` <= 0.5.20: the attention-TP
    group, else the MoE expert-parallel group when it has several ranks, else
    the MoE-TP group; 0.5.9: the TP group), by SGLang's own GroupCoordinator."""
    from sglang.srt.distributed import parallel_state as ps

    initialised = getattr(ps, "model_parallel_is_initialized", None)
    if initialised is not None and not initialised():
        return x  # a single process (no SGLang groups): nothing to reduce
    if use_attn_tp_group is None:
        return ps.get_tp_group().all_reduce(x)
    if use_attn_tp_group:
        return ps.get_attn_tp_group().all_reduce(x)
    ep = ps.get_moe_ep_group()
    return (ep if ep.world_size > 1 else ps.get_moe_tp_group()).all_reduce(x)


def fallback_reduces() -> bool:
    """Whether the running SGLang line all-reduces before its norm when FlashInfer
    declines (0.5.21+: ``deferred_post_experts_all_reduce``); <= 0.5.20 only its
    ROCm aiter route does."""
    layernorm = sys.modules.get("sglang.srt.layers.layernorm")
    fused = getattr(layernorm, "_forward_with_allreduce_fusion", None)
    names = getattr(getattr(fused, "__code__", None), "co_names", ())
    return "deferred_post_experts_all_reduce" in names
