"""The capturing norms (the mechanism every family shares): subclasses of SGLang's own
RMSNorm class, swapped in by class so names, ``state_dict`` keys and ``isinstance``
stay SGLang's. A captured layer's input norm runs the fused add + RMSNorm + slot
store (the residual-in-slot path: the new residual written into the slot only; the
slot-copy path: stored in place and copied into the slot) or SGLang's own code and then
stores the reduced residual; on the residual-in-slot path the layer's post-attention
norm writes its residual out of place; the logits processor is handed the packed
``[T, K*H]`` buffer."""

import functools
import inspect
import sys
from typing import Optional

import torch

from eagle_capture import ops
from eagle_capture.integrations.sglang import allreduce
from eagle_capture.integrations.sglang.server_modes import (
    attention_tp_gather,
    capturing_cuda_graph,
    flashinfer_allreduce_unavailable,
)
from eagle_capture.integrations.sglang.state import SlotResidual, logger

__all__ = ["CapturingLogitsMixin", "CapturingNormMixin", "SlotResidualPostNormMixin", "with_mixin"]


def _batch_invariant_mode(norm: torch.nn.Module) -> bool:
    """SGLang's batch-invariant mode routes residual norms to forward_native;
    keep its own path there (read from the norm's module, as layernorm.py does)."""
    flag = getattr(sys.modules.get(type(norm).__module__), "is_batch_invariant_mode_enabled", None)
    return bool(flag()) if flag is not None else False


def _fuses_input_quant(norm: torch.nn.Module, quant_linear) -> bool:
    """Whether SGLang's norm would fuse ``quant_linear``'s static per-tensor FP8
    input quantization into its output (0.5.20: the ``quant_linear`` argument;
    0.5.23: ``fuse_input_quant``), read with the norm module's own test. Our
    kernel writes the plain normed output, so SGLang's own code runs there."""
    if quant_linear is None:
        return False
    module = _module_with_fp8_scale_test(type(norm))
    if module is None:
        return True  # a line whose test we cannot read: never drop its quantization
    return module._fp8_static_input_scale(quant_linear) is not None


@functools.lru_cache(maxsize=None)
def _module_with_fp8_scale_test(norm_class: type):
    """The module (of the norm's class or a base of it) holding SGLang's
    ``_fp8_static_input_scale``: found once per class, the norm being on the hot path."""
    for cls in norm_class.__mro__:
        module = sys.modules.get(cls.__module__)
        if hasattr(module, "_fp8_static_input_scale"):
            return module
    return None


class CapturingNormMixin:
    """Methods of the capturing subclass; ``_eagle_capture`` (state) and
    ``_eagle_layer_id`` are set on the instance at install."""

    def _eagle_fusable(self, x, residual, post_residual_addition, kwargs) -> bool:
        """The plain fused_add_rmsnorm case our kernel reproduces; anything else
        (SGLang's special norms and modes, a fused FP8 input quant) runs SGLang's
        own code."""
        extra = {k: v for k, v in kwargs.items() if v is not None}
        quant_linear = extra.pop("quant_linear", None) or getattr(self, "_quant_linear", None)
        return (
            residual is not None
            and not extra
            and x.dim() == 2
            and residual.dim() == 2
            and x.dtype == residual.dtype
            and x.shape == residual.shape
            and x.stride(-1) == 1
            and residual.stride(-1) == 1
            and (post_residual_addition is None or post_residual_addition.shape == x.shape)
            and getattr(self, "has_weight", True)
            and getattr(self, "variance_size_override", None) is None
            and not getattr(self, "cast_x_before_out_mul", False)
            and not getattr(self, "fp32_residual", False)
            and getattr(self, "override_orig_dtype", None) is None
            and not getattr(self, "x_pad_to_multiple", 0)
            and self.weight.shape == (x.shape[1],)
            and not _batch_invariant_mode(self)
            and not _fuses_input_quant(self, quant_linear)
        )

    def _eagle_store(self, value: torch.Tensor, fused: bool) -> None:
        state = self._eagle_capture
        buffer = state.buffer_for(value.shape[0])
        ops.add_capture(value, None, buffer.aux, buffer.slot_of(self._eagle_layer_id))
        state.record(self._eagle_layer_id, value.shape[0], fused, value)
        if state.verifying(value):  # a copy of SGLang's own residual: compare the slot
            state.verify_layer(self._eagle_layer_id, buffer, value.shape[0], value)

    def forward(self, x, residual=None, post_residual_addition=None, **kwargs):
        state = self._eagle_capture
        if (
            state.in_allreduce_fusion == self._eagle_layer_id
            and not state.fallback_reduces
            and residual is not None
            and torch.version.hip is None
        ):
            # SGLang <= 0.5.20's fallback after FlashInfer declined: x is still this
            # rank's partial sum (only its ROCm aiter route reduces first). Reduce
            # it as the fusion would have, so that neither the capture nor the
            # layer sees the unreduced value.
            x = allreduce.fallback_all_reduce(x, state.fusion_group_arg)
            if not torch.compiler.is_compiling():
                state.reduced_on_decline += 1
        if state.disabled:  # switched back to SGLang's own capture
            return super().forward(x, residual, post_residual_addition, **kwargs)
        if self._eagle_layer_id in state.scattered_layers and residual is not None:
            # This rank holds its slice of the rows: SGLang's own norm on it, then
            # the new residual gathered over the attention-TP group, in rank order
            # (what SGLang's capture gathers), and stored into the slot.
            out = super().forward(x, residual, post_residual_addition, **kwargs)
            self._eagle_store(attention_tp_gather(out[1]), fused=False)
            if not torch.compiler.is_compiling() and not capturing_cuda_graph(x):
                state.gathered_calls += 1  # counted as record() counts the others
            return out
        if not self._eagle_fusable(x, residual, post_residual_addition, kwargs):
            out = super().forward(x, residual, post_residual_addition, **kwargs)
            # The capture is the residual this norm leaves: the input itself when
            # called without one (layer 0's embedding, or a residual updated
            # elsewhere first, as layer_boundary's non-plain updates do).
            new_residual = out[1] if residual is not None else x
            if state.in_allreduce_fusion == self._eagle_layer_id:
                state.stored_in_fusion = True
            self._eagle_store(new_residual, fused=False)
            return out
        # SGLang's own norm on copies, as the reference of the live self-check
        # (EAGLE_CAPTURE_VERIFY): FlashInfer's fused_add_rmsnorm on the GPU.
        # (forward_native, the CPU reference, adds a post_residual_addition in
        # another order than forward_cuda, which we follow: not compared there.)
        reference = (
            super().forward(x.clone(), residual.clone())
            if post_residual_addition is None and state.verifying(x)
            else None
        )
        if post_residual_addition is not None:
            # SGLang adds it to the residual first, out of place (forward_cuda):
            # h + (r + p); the caller's residual is left as it was.
            residual = residual + post_residual_addition
        num_tokens = x.shape[0]
        if state.in_allreduce_fusion == self._eagle_layer_id:
            state.stored_in_fusion = True  # SGLang's fallback after its own all-reduce
        buffer = state.buffer_for(num_tokens)
        slot = buffer.slot_of(self._eagle_layer_id)
        in_slot = (
            state.residual_in_slot_enabled
            and num_tokens > state.residual_in_slot_above
            and not torch.compiler.is_compiling()
        )
        if in_slot:
            # The residual-in-slot path: the new residual is written once, into the slot, and handed
            # on as the residual; the incoming one is dead from here (SGLang would
            # overwrite it in place) and becomes the post norm's output.
            state.check_slot_residual_consumed()
            ops.add_rmsnorm_into_slot(
                x,
                residual,
                self.weight,
                self.variance_epsilon,
                buffer.aux,
                slot,
                norm_fp32_sum=True,
            )
            new_residual = buffer.aux[:num_tokens, slot]
            state.residual_in_slot = SlotResidual(self._eagle_layer_id, new_residual, residual)
            state.slot_residual_calls += 1
        else:
            ops.add_rmsnorm_capture(
                x,
                residual,
                self.weight,
                self.variance_epsilon,
                buffer.aux,
                slot,
                norm_fp32_sum=True,
            )
            new_residual = residual
        state.record(self._eagle_layer_id, num_tokens, True, x)
        if reference is not None:
            ref_x, ref_r = reference
            # A mismatch writes SGLang's residual into the slot (the residual-in-slot
            # path's residual).
            if not state.verify_layer(self._eagle_layer_id, buffer, num_tokens, ref_r, x, ref_x):
                if not in_slot:
                    residual.copy_(ref_r)
        return x, new_residual

    def forward_with_allreduce_fusion(self, x, residual=None, *args, **kwargs):
        # x is this rank's partial sum of the previous layer's output; SGLang's
        # fused all-reduce + add + RMSNorm writes a fresh, *reduced* residual_out.
        # The capture is that reduced residual, never the partial.
        state = self._eagle_capture
        if state.disabled or residual is None:
            return super().forward_with_allreduce_fusion(x, residual, *args, **kwargs)
        # FlashInfer declines non-contiguous tensors (and then SGLang <= 0.5.20
        # runs its fallback norm on the partial): hand it contiguous ones.
        x, residual = x.contiguous(), residual.contiguous()
        post_residual_addition = args[0] if args else kwargs.get("post_residual_addition")
        reducer = state.allreduce
        if (
            reducer is not None
            and post_residual_addition is None
            and self._eagle_fusable(x, residual, None, {})
            and reducer.takes(x)
        ):
            path = reducer.path_for(x.shape[0])
            if path != allreduce.ENGINE_FUSION:
                return self._eagle_reduce_add_rmsnorm(reducer, path, x, residual)
        eager = not torch.compiler.is_compiling()
        unavailable = flashinfer_allreduce_unavailable() if eager else None
        if eager:
            # When FlashInfer declines, SGLang calls this norm's forward() (our
            # capturing one, after an all-reduce from 0.5.21; before that, forward()
            # reduces first): it then stores the capture itself.
            state.in_allreduce_fusion = self._eagle_layer_id
            state.fusion_group_arg = _use_attn_tp_group_arg(
                super().forward_with_allreduce_fusion, args, kwargs
            )
            state.stored_in_fusion = False
        try:
            out = super().forward_with_allreduce_fusion(x, residual, *args, **kwargs)
        finally:
            if eager:
                state.in_allreduce_fusion = None
        if (
            eager
            and unavailable is False
            and flashinfer_allreduce_unavailable()
            and not state.fallback_reduces
        ):
            logger().error(
                "eagle_capture: SGLang's FlashInfer all-reduce fusion could not set up its "
                "workspace in this forward (layer %d): SGLang <= 0.5.20 then runs its norms on "
                "the per-rank partial sums. The captured layers reduced first; the other layers "
                "of this forward (and SGLang's own capture) are not reduced. Later forwards "
                "take SGLang's explicit all-reduce",
                self._eagle_layer_id,
            )
        if eager and state.allreduce is not None:
            state.allreduce.calls[allreduce.ENGINE_FUSION] += 1
        if not (eager and state.stored_in_fusion):
            self._eagle_store(out[1], fused=False)
        return out

    def _eagle_reduce_add_rmsnorm(self, reducer, path, x, residual):
        """The all-reduce SGLang would fuse here, by ``path`` (one_shot: the one
        kernel; nccl: SGLang's all-reduce, then the fused op), with the add, the
        norm and the capture; in place, as SGLang's explicit all-reduce + norm."""
        state = self._eagle_capture
        num_tokens = x.shape[0]
        buffer = state.buffer_for(num_tokens)
        slot = buffer.slot_of(self._eagle_layer_id)
        reference = None
        if state.verifying(x):  # SGLang's all-reduce and norm on copies
            reference = super().forward(reducer.reduce(x.clone()), residual.clone())
        if path == allreduce.ONE_SHOT:
            reducer.one_shot.reduce_add_rmsnorm(
                x,
                residual,
                self.weight,
                self.variance_epsilon,
                buffer.aux,
                slot,
                norm_fp32_sum=True,
            )
        else:
            x = reducer.reduce(x)
            ops.add_rmsnorm_capture(
                x,
                residual,
                self.weight,
                self.variance_epsilon,
                buffer.aux,
                slot,
                norm_fp32_sum=True,
            )
        state.record(self._eagle_layer_id, num_tokens, True, x)
        if not torch.compiler.is_compiling() and not capturing_cuda_graph(x):
            reducer.calls[path] += 1
        if reference is not None:
            ref_x, ref_r = reference
            # The one kernel sums the partials in fp32 in rank order, SGLang's
            # all-reduce in its own order and dtype: equal up to rounding there.
            exact = path != allreduce.ONE_SHOT
            if not state.verify_layer(
                self._eagle_layer_id, buffer, num_tokens, ref_r, x, ref_x, residual_exact=exact
            ):
                residual.copy_(ref_r)
        return x, residual


def _use_attn_tp_group_arg(sglang_method, args, kwargs) -> Optional[bool]:
    """The ``use_attn_tp_group`` of a ``forward_with_allreduce_fusion`` call
    (the parameter after ``post_residual_addition``); None where SGLang's
    method has no such parameter (0.5.9: it reduces over the TP group)."""
    if "use_attn_tp_group" in kwargs:
        return bool(kwargs["use_attn_tp_group"])
    default = _use_attn_tp_group_default(getattr(sglang_method, "__func__", sglang_method))
    if default is None:
        return None
    return bool(args[1]) if len(args) > 1 else default


@functools.lru_cache(maxsize=None)
def _use_attn_tp_group_default(function) -> Optional[bool]:
    """The default of ``use_attn_tp_group`` in SGLang's method, None without it
    (read once per function: ``inspect.signature`` costs tens of us)."""
    param = inspect.signature(function).parameters.get("use_attn_tp_group")
    return None if param is None else bool(param.default)


class SlotResidualPostNormMixin:
    """The post-attention norm of a captured layer on the residual-in-slot path: its residual is
    the slot, which SGLang's in-place fused_add_rmsnorm would overwrite with the
    next residual. It writes that one into the spare tensor instead (one fused
    add + RMSNorm, out of place), so the capture stays and the layer's output
    residual is bit-identical to SGLang's. ``_eagle_capture`` and
    ``_eagle_layer_id`` are set on the instance at install."""

    def _eagle_take_slot(self, residual) -> Optional[torch.Tensor]:
        """The spare to write into when ``residual`` is this layer's slot, else None."""
        state = self._eagle_capture
        pending = state.residual_in_slot
        if (
            pending is None
            or pending.layer_id != self._eagle_layer_id
            or residual is not pending.view
        ):
            return None
        state.residual_in_slot = None
        return pending.spare

    def forward(self, x, residual=None, post_residual_addition=None, **kwargs):
        spare = self._eagle_take_slot(residual)
        if spare is None:
            return super().forward(x, residual, post_residual_addition, **kwargs)
        if (
            CapturingNormMixin._eagle_fusable(self, x, residual, post_residual_addition, kwargs)
            and post_residual_addition is None
            and spare.shape == x.shape
            and spare.dtype == x.dtype
            and spare.is_contiguous()
        ):
            ops.add_rmsnorm_out(
                x, residual, self.weight, self.variance_epsilon, spare, norm_fp32_sum=True
            )
            return x, spare
        # Any other norm path: SGLang's own code, on the spare holding a copy.
        spare.copy_(residual)
        return super().forward(x, spare, post_residual_addition, **kwargs)

    def forward_with_allreduce_fusion(self, x, residual, *args, **kwargs):
        # FlashInfer's fusion reads the residual and writes a fresh residual_out,
        # but declines a strided one: hand it the spare holding a copy (the
        # install keeps the residual-in-slot path to forwards the fusion does not take).
        spare = self._eagle_take_slot(residual)
        if spare is not None:
            spare.copy_(residual)
            residual = spare
        return super().forward_with_allreduce_fusion(x, residual, *args, **kwargs)


@functools.lru_cache(maxsize=None)
def with_mixin(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin``'s methods first in the MRO: same name and module,
    ``isinstance`` of ``cls`` still holds (one class per pair, so repeated
    installs share it)."""
    return type(
        cls.__name__,
        (mixin, cls),
        {"__module__": cls.__module__, "__qualname__": f"{cls.__qualname__}[eagle_capture]"},
    )


class CapturingLogitsMixin:
    def forward(
        self,
        input_ids,
        hidden_states,
        lm_head,
        logits_metadata,
        aux_hidden_states=None,
        *args,
        **kwargs,
    ):
        state = self._eagle_capture
        if state.disabled:  # SGLang's own capture is back on: pass its aux through
            return super().forward(
                input_ids,
                hidden_states,
                lm_head,
                logits_metadata,
                aux_hidden_states,
                *args,
                **kwargs,
            )
        if aux_hidden_states is not None:
            raise RuntimeError(
                "eagle_capture: the model handed the LogitsProcessor its own aux "
                "hidden states: set_eagle3_layers_to_capture was called again "
                "after install_eagle3_capture; install again after it"
            )
        num_tokens = hidden_states.shape[0]
        state.check_complete(num_tokens)
        buffer = state.buffer_for(num_tokens)
        state.overflow = None  # the view below keeps a per-forward buffer alive
        # An idle rank (DP attention: no requests of its own) still joins the
        # self-check's collectives; a single process has nothing to check then.
        if state.verifying(hidden_states) and (num_tokens or state.verify_group is not None):
            state.finish_verified_forward(buffer, num_tokens)
        packed = buffer.result(num_tokens)
        if state.copy_out:
            packed = packed.clone()
        aux_hidden_states = packed if state.packed_tensor else [packed]
        return super().forward(
            input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states, *args, **kwargs
        )
