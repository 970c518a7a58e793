"""The capturing norms: subclasses of vLLM's own norm class, swapped in by class
so names, ``state_dict`` keys and ``isinstance`` stay vLLM's. A captured layer's
input norm (the final norm for id ``num_layers``) runs the project's add + RMSNorm
that also stores the new residual into the layer's slot: eager, written into the
slot only and handed on as the residual (the residual-in-slot path), the layer's
post-attention norm then writing out of place; compiled, in place plus the slot (the
slot-copy path), or after vLLM's own norm where its all-reduce fusion pass runs. With
the self-check on, each call also compares with vLLM's own add and norm on copies."""

from __future__ import annotations

from typing import Optional

import torch
from vllm.model_executor.layers.layernorm import RMSNorm

from eagle_capture import ops
from eagle_capture.integrations.core.selfcheck import beyond_rounding, norm_rtol
from eagle_capture.integrations.vllm.state import CaptureState, SlotResidual, capturing_graph

__all__ = ["NOBODY", "POST_NORM", "capturing_class", "plain_rmsnorm", "slot_taking_norm"]


def _capture_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
    """The capturing norm's call: vLLM's ``RMSNorm(x, residual)`` -> ``(normed,
    new residual)`` with the new residual also stored into this layer's slot:
    eager, written into the slot only and handed on as the residual (the
    residual-in-slot path); compiled, in place as vLLM's in-place implementations do
    plus the slot (the slot-copy path), or after vLLM's own norm where its all-reduce
    fusion pass runs."""
    state: CaptureState = self._eagle_capture_state
    if state.disabled:
        return self._eagle_capture_base.forward(self, x, residual)
    eager = not torch.compiler.is_compiling()
    if residual is None:
        # Layer 0 of the first stage: the stream is the embedding output itself
        # (vLLM's mixin loops capture it as is for id 0), stored before the norm.
        ops.add_capture(x, None, state.active.aux, self._eagle_capture_slot)
        if eager and not capturing_graph(x):
            state.stored_rows[self._eagle_capture_layer] = x.shape[0]
            if state.verify_left > 0:
                captured = state.active.aux[: x.shape[0], self._eagle_capture_slot]
                if not torch.equal(captured, x):
                    state.verify_mismatches.append(
                        f"layer {self._eagle_capture_layer}: capture differs from the "
                        f"embedding output vLLM captures"
                    )
        return self._eagle_capture_base.forward(self, x, residual)
    reference = None
    if eager and state.verify_left > 0:
        # vLLM's own capture (its expression) and its own norm, on copies.
        reference = (
            x + residual,
            self._eagle_capture_base.forward(self, x.clone(), residual.clone()),
        )
    aux, slot = state.active.aux, self._eagle_capture_slot
    if state.keep_allreduce_fusion and not eager:
        # vLLM's AllReduceFusionPass matches all_reduce -> its fused_add_rms_norm IR op
        # and swaps in FlashInfer's all-reduce + add + RMSNorm: the norm stays vLLM's
        # (one pattern like every other layer's) and the capture copies its residual.
        normed, new_residual = self._eagle_capture_base.forward(self, x, residual)
        ops.add_capture(new_residual, None, aux, slot)
        return normed, new_residual
    if eager and state.residual_in_slot and self._eagle_slot_reader is not None:
        # The residual-in-slot path: one write of the new residual, into the slot.
        state.check_slot_consumed()
        ops.add_rmsnorm_into_slot(
            x,
            residual,
            self.weight,
            self.variance_epsilon,
            aux,
            slot,
            norm_fp32_sum=state.norm_fp32_sum,
        )
        new_residual = aux[: x.shape[0], slot]
        if self._eagle_slot_reader == POST_NORM:  # else the final norm's, discarded
            state.pending_slot = SlotResidual(self._eagle_capture_layer, new_residual, residual)
        state.slot_residual_calls += 1
    else:
        ops.add_rmsnorm_capture(
            x,
            residual,
            self.weight,
            self.variance_epsilon,
            aux,
            slot,
            norm_fp32_sum=state.norm_fp32_sum,
        )
        new_residual = residual
    if eager and not capturing_graph(x):
        state.stored_rows[self._eagle_capture_layer] = x.shape[0]
        state.fused_calls += 1
        if reference is not None:
            _compare(
                state,
                self._eagle_capture_layer,
                aux[: x.shape[0], slot],
                x,
                new_residual,
                reference,
            )
    return x, new_residual


def slot_taking_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
    """A captured layer's post-attention norm on the residual-in-slot path: when ``residual`` is
    the slot its input norm left, the next residual goes into the spare (vLLM's
    in-place norm would overwrite the capture), bit-identical to vLLM's."""
    state: CaptureState = self._eagle_capture_state
    pending = state.pending_slot
    if (
        pending is None
        or pending.layer_id != self._eagle_capture_layer
        or residual is not pending.view
    ):
        return self._eagle_capture_base.forward(self, x, residual)
    state.pending_slot = None
    spare = pending.spare
    if spare.shape == x.shape and spare.dtype == x.dtype and spare.is_contiguous():
        ops.add_rmsnorm_out(
            x,
            residual,
            self.weight,
            self.variance_epsilon,
            spare,
            norm_fp32_sum=state.norm_fp32_sum,
        )
        return x, spare
    spare = residual.clone()  # vLLM's own norm on a copy (never reached in vLLM 0.32's loops)
    return self._eagle_capture_base.forward(self, x, spare)


def _compare(state: CaptureState, layer: int, captured, normed, residual, reference) -> None:
    expected, (ref_normed, ref_residual) = reference
    if not torch.equal(captured, expected):
        bad = (captured != expected).any(dim=-1).nonzero().flatten()[:4].tolist()
        state.verify_mismatches.append(
            f"layer {layer}: capture differs from vLLM's hidden_states + residual (rows {bad}...)"
        )
    if not torch.equal(residual, ref_residual):
        state.verify_mismatches.append(f"layer {layer}: new residual differs from vLLM's norm")
    dev = (
        ((normed.float() - ref_normed.float()).abs() / ref_normed.float().abs().clamp_min(1e-6))
        .max()
        .item()
        if normed.numel()
        else 0.0
    )
    state.verify_norm_dev = max(state.verify_norm_dev, dev)
    rtol = norm_rtol(normed.dtype)
    if beyond_rounding(normed, ref_normed):
        state.verify_mismatches.append(
            f"layer {layer}: normed output off vLLM's norm by "
            f"{dev:.3g} (relative, tolerance {rtol:.3g})"
        )


# Who reads a captured norm's new residual next, for the residual-in-slot path: the
# layer's post-attention norm (swapped to take it), or nobody (the final norm: every
# family discards it).
POST_NORM, NOBODY = "post-attention norm", "nobody"


def plain_rmsnorm(norm) -> bool:
    """vLLM's plain weighted ``RMSNorm``: the norm the fused capture replaces."""
    return isinstance(norm, RMSNorm) and norm.has_weight and norm.variance_size_override is None


_NORM_CLASSES: dict[tuple, type] = {}


def capturing_class(cls: type, forward=_capture_norm) -> type:
    """A subclass of vLLM's norm class whose call also captures (or, for
    ``slot_taking_norm``, takes the slot's residual): the instance's class is
    swapped; names, parameters and ``isinstance`` unchanged."""
    key = (cls, forward)
    if key not in _NORM_CLASSES:
        prefix = "EagleCapture" if forward is _capture_norm else "EagleSlotTaking"
        _NORM_CLASSES[key] = type(
            f"{prefix}{cls.__name__}",
            (cls,),
            {"forward": forward, "_eagle_capture_base": cls, "__module__": __name__},
        )
    return _NORM_CLASSES[key]
