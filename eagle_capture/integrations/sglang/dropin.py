"""Drop-in fused EAGLE-3 capture for SGLang's ``DeepseekV2ForCausalLM``
(DeepSeek-V3, Kimi-K2/K2.5), SGLang 0.5.9 - 0.5.23: :func:`install_eagle3_capture`.

Every line's captured value is the new residual that a captured layer's input
norm writes (``norm(x, residual, post_residual_addition)``); what each line
does around it is in docs/engine_facts.md section 1. The install

1. swaps each captured layer's input-norm *class* for a capturing subclass of
   its real class (names, ``state_dict`` keys, weight loading and ``isinstance``
   unchanged): the plain call runs our fused add + RMSNorm + slot store (path f:
   the new residual written into the slot only and handed on as a view; the
   layer's post-attention norm then writes out of place; path e: a second
   write into the slot, under torch.compile and where SGLang's all-reduce
   fusion may run); every other branch runs SGLang's own code, then stores
   the reduced residual;
2. empties ``model.layers_to_capture`` so SGLang's own capture never runs;
3. swaps the ``LogitsProcessor``'s class so it is handed the packed
   ``[T, K*H]`` view of our buffer (a list of one for <= 0.5.13).

Only classes are swapped, never an instance ``forward``: SGLang's piecewise
CUDA graphs replace instance forwards, so installing before or after them works.
Rows token-scattered over an attention-TP group are all-gathered into the slot
over SGLang's own group. Refused at install, with the reason: a capture not
enabled, another stage's layers, layer 0 (unless ``allow_embedding=True``),
two-batch overlap, context parallelism, layernorm sequence parallelism.
Checked on every eager forward: each captured layer stored exactly T rows, and
SGLang's own capture was not re-enabled.
"""

import functools
import inspect
import sys
from typing import NamedTuple, Optional

import torch

from eagle_capture import ops
from eagle_capture.buffer import AuxCaptureBuffer
from eagle_capture.integrations.settings import VERIFY_NORM_RTOL
from eagle_capture.integrations.sglang import allreduce

__all__ = ["CaptureState", "UnsupportedServer", "WrongCaptureLayers", "install_eagle3_capture",
           "reapply_after_reconfigure", "text_model_of"]


class UnsupportedServer(ValueError):
    """A server mode the fused capture does not handle (SGLang's own capture
    stays right there): the plugin logs it and leaves SGLang alone."""


class WrongCaptureLayers(ValueError):
    """Layer ids that SGLang's own capture would get wrong too (the draft would
    not receive what it was trained on): the plugin refuses to start."""


class CaptureState:
    """What the capturing norms and logits processor of one model share: the
    buffer, the captured layers, the rows each layer stored in the current
    eager forward (for the completeness check), and the live self-check."""

    def __init__(self, buffer: AuxCaptureBuffer, layer_ids: list[int], surface: str,
                 packed_tensor: bool, *, sglang_layers: list[int],
                 causal_lm: Optional[torch.nn.Module] = None) -> None:
        self.buffer = buffer
        self.layer_ids = layer_ids
        self.surface = surface
        self.packed_tensor = packed_tensor   # hand the LogitsProcessor a tensor (>= 0.5.18)
        self.sglang_layers = list(sglang_layers)  # SGLang's layers_to_capture, to switch back
        self._causal_lm = causal_lm
        self.stored_rows: dict[int, int] = {}
        self.fused_calls = 0      # captures done by our fused kernel (tests count these)
        self.fallback_calls = 0   # SGLang's own norm path + a slot store
        # A forward with more tokens than the buffer has rows (eager only): a buffer
        # for that forward alone, as SGLang's own capture allocates one per forward.
        self.overflow: Optional[AuxCaptureBuffer] = None
        self.overflow_forwards = 0
        self.graph_captured = False   # a CUDA graph was captured with our capture in it
        # Live self-check (EAGLE_CAPTURE_VERIFY=N): compare with SGLang's own norm.
        self.verify_left = 0
        self.verify_total = 0
        self.verify_group = None      # TP process group: every rank takes one decision
        self.verify_rows_group = None  # ranks holding the same rows (attention TP): compared
        self.verify_mismatches: list[str] = []
        self.verify_norm_dev = 0.0
        self.verified_forwards = 0
        self.disabled = False         # switched back to SGLang's own capture
        self.copy_out = False         # hand the LogitsProcessor a copy (return_hidden_states)
        self.in_allreduce_fusion = None   # layer inside forward_with_allreduce_fusion (eager)
        self.stored_in_fusion = False     # ... whose fallback already stored the capture
        self.fusion_group_arg = None      # ... and its use_attn_tp_group (None: 0.5.9's TP)
        # Whether SGLang's fusion all-reduces before its fallback norm when FlashInfer
        # declines (0.5.22+); where not, the captured norm reduces first.
        self.fallback_reduces = True
        self.reduced_on_decline = 0
        # The captured layers' all-reduce when SGLang would fuse it
        # (EAGLE_CAPTURE_FUSED_ALLREDUCE=1; allreduce.CapturedLayerAllReduce).
        self.allreduce = None
        # Path f (the residual itself lives in the slot; no extra write): off until
        # install finds the captured layers' post-attention norms. Its input norm
        # takes it for forwards above ``residual_in_slot_above`` tokens (at TP > 1,
        # SGLang's FlashInfer all-reduce fusion takes smaller ones and wants a
        # contiguous residual), and leaves ``residual_in_slot`` for the post norm.
        self.residual_in_slot_enabled = False
        self.residual_in_slot_above = 0
        self.residual_in_slot: Optional[_SlotResidual] = None
        self.slot_residual_calls = 0      # input norms that left the residual in the slot
        # Captured layers whose input rows are token-scattered over the attention-TP
        # group (its slice on each rank): captured gathered.
        self.scattered_layers: frozenset = frozenset()
        self.gathered_calls = 0

    def buffer_for(self, num_tokens: int) -> AuxCaptureBuffer:
        """The buffer this forward's captures go to."""
        if num_tokens <= self.buffer.max_tokens or torch.compiler.is_compiling():
            return self.buffer
        if _capturing_cuda_graph(self.buffer.aux):
            raise ValueError(
                f"eagle_capture: a CUDA graph of {num_tokens} tokens is being captured but the "
                f"aux buffer has {self.buffer.max_tokens} rows: size it for the largest graph "
                f"(the plugin does, from the server's arguments)")
        if self.overflow is None or self.overflow.max_tokens != num_tokens:
            self.overflow = AuxCaptureBuffer(num_tokens, self.buffer.hidden_size, self.layer_ids,
                                             dtype=self.buffer.aux.dtype,
                                             device=self.buffer.aux.device)
            self.overflow_forwards += 1
            if self.overflow_forwards in (1, 10, 100) or self.overflow_forwards % 1000 == 0:
                _log().warning(
                    "eagle_capture: a forward of %d tokens exceeds the aux buffer's %d rows: its "
                    "captures go to a buffer allocated for this forward (as SGLang's own capture "
                    "does; %d such forwards so far). Raise EAGLE_CAPTURE_MAX_TOKENS to avoid it",
                    num_tokens, self.buffer.max_tokens, self.overflow_forwards)
        return self.overflow

    def record(self, layer_id: int, rows: int, fused: bool, like: torch.Tensor) -> None:
        # Under dynamo (piecewise CUDA graphs, --enable-torch-compile) Python
        # state must not be mutated from traced code; the check is eager-only.
        if torch.compiler.is_compiling():
            return
        if _capturing_cuda_graph(like):
            self.graph_captured = True
            return   # the graph runner's forwards are not served; nothing to check
        self.stored_rows[layer_id] = rows
        if fused:
            self.fused_calls += 1
        else:
            self.fallback_calls += 1

    def check_complete(self, num_tokens: int) -> None:
        """Every captured layer stored ``num_tokens`` rows in this forward."""
        stored, self.stored_rows = self.stored_rows, {}
        if torch.compiler.is_compiling() or (not stored and _in_compiled_region()):
            return  # compiled region: the norms' Python did not run
        self.check_slot_residual_consumed()
        if num_tokens == 0:
            return  # SGLang skips the norms of an empty (idle) batch: nothing to store
        if not stored and _capturing_cuda_graph(self.buffer.aux):
            return
        missing = [i for i in self.layer_ids if i not in stored]
        wrong = {i: n for i, n in stored.items() if n != num_tokens}
        if missing or wrong:
            problems = []
            if missing:
                problems.append(f"captured layer(s) {missing} stored nothing")
            problems += [f"layer {i} stored {n} rows" for i, n in sorted(wrong.items())]
            raise RuntimeError(
                f"eagle_capture: in this forward of {num_tokens} tokens "
                f"{'; '.join(problems)}: a path bypassed the captured input norm "
                f"({self.surface}) and the draft would read a stale buffer. Disable that path "
                f"(a backend fusion provider, two-batch overlap, scattered rows) or keep "
                f"SGLang's own capture")

    def check_slot_residual_consumed(self) -> None:
        """A residual left in a slot (path f) must have been taken by the layer's
        post-attention norm before anything else reads or updates it."""
        pending, self.residual_in_slot = self.residual_in_slot, None
        if pending is not None:
            raise RuntimeError(
                f"eagle_capture: layer {pending.layer_id}'s residual was left in its aux slot "
                f"but its post-attention norm did not take it ({self.surface}): another path "
                f"updates the residual there and would overwrite the capture. Install with "
                f"residual_in_slot=False (EAGLE_CAPTURE_RESIDUAL_IN_SLOT=0)")

    # Live self-check ------------------------------------------------------------

    def verifying(self, like: torch.Tensor) -> bool:
        return (self.verify_left > 0 and not torch.compiler.is_compiling()
                and not _capturing_cuda_graph(like))

    def verify_layer(self, layer_id: int, buffer: AuxCaptureBuffer, num_tokens: int,
                     ref_residual: torch.Tensor, normed: Optional[torch.Tensor] = None,
                     ref_normed: Optional[torch.Tensor] = None,
                     residual_exact: bool = True) -> bool:
        """Compare one layer's capture (and normed output) with SGLang's own; on a
        mismatch write SGLang's values into the slot and report. True if equal.
        ``residual_exact=False``: the capture within the normed output's rounding
        tolerance (an all-reduce summed in another order than SGLang's)."""
        slot = buffer.slot_of(layer_id)
        got = buffer.aux[:num_tokens, slot]
        problems = []
        if residual_exact and not torch.equal(got, ref_residual):
            bad = (got != ref_residual).any(dim=-1).nonzero().flatten()
            problems.append(f"capture differs from SGLang's residual in {bad.numel()} of "
                            f"{num_tokens} rows (first row {bad[0].item() if bad.numel() else '?'})")
        if not residual_exact and num_tokens:
            worst, beyond = _deviation(got, ref_residual)
            if beyond:
                problems.append(f"capture differs from SGLang's all-reduced residual by up to "
                                f"{worst:.3g}, more than rounding")
        if normed is not None and num_tokens:
            worst, beyond = _deviation(normed, ref_normed)
            self.verify_norm_dev = max(self.verify_norm_dev, worst)
            if beyond:
                rtol = VERIFY_NORM_RTOL.get(normed.dtype, 2.0 ** -6)
                problems.append(f"normed output differs from SGLang's norm by up to "
                                f"{worst:.3g} (tolerance {rtol:.3g} relative)")
        if not problems:
            return True
        got.copy_(ref_residual)          # this forward still hands the draft SGLang's value
        if normed is not None:
            normed.copy_(ref_normed)
        self.verify_mismatches.append(f"layer {layer_id} (slot {slot}): " + "; ".join(problems))
        return False

    def finish_verified_forward(self, buffer: AuxCaptureBuffer, num_tokens: int) -> None:
        """After a verified forward: the cross-rank check, one log line, and the
        switch back to SGLang's own capture on a mismatch."""
        def log(text: str, error: bool) -> None:
            (_log().error if error else _log().info)(text)

        self.verify_left -= 1
        self.verified_forwards += 1
        step = f"{self.verified_forwards}/{self.verify_total}"
        tp_note = "1 rank"
        mismatches, self.verify_mismatches = self.verify_mismatches, []
        peer_mismatch = False
        if self.verify_group is not None:
            from eagle_capture.parallel.tp import CaptureConsistencyError, check_capture_consistency
            import torch.distributed as dist
            world = dist.get_world_size(self.verify_group)
            # Every rank takes the same decision (a rank switching back alone would
            # leave its peers in the next forward's collectives by themselves).
            flag = torch.tensor([int(bool(mismatches))], dtype=torch.int32,
                                device=buffer.aux.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.verify_group)
            peer_mismatch = bool(flag.item()) and not mismatches
            # Only ranks holding the same rows are compared: under DP attention
            # each attention-TP group serves its own requests.
            rows_group = self.verify_rows_group
            rows_world = dist.get_world_size(rows_group) if rows_group is not None else 1
            same = "TP ranks" if rows_world == world else "attention-TP ranks"
            try:
                if rows_group is None:
                    tp_note = (f"{world} TP ranks with DP attention: each holds its own "
                               f"requests' rows (no two ranks compared)")
                elif not num_tokens:   # the whole attention-TP group is idle
                    tp_note = "no rows on this rank (idle)"
                else:
                    check_capture_consistency(buffer, num_tokens, buffer.hidden_size,
                                              rows_group)
                    tp_note = f"identical on all {rows_world} {same}"
            except CaptureConsistencyError as e:
                tp_note = f"NOT identical across the {rows_world} {same}"
                why = (" Each rank's capture equals SGLang's own there, so SGLang's capture hands "
                       "the draft the same: the deployment itself is inconsistent"
                       if not flag.item() else "")
                log(f"eagle_capture verify {step}: {e}.{why}", True)
        if mismatches:
            log(f"eagle_capture verify {step}: T={num_tokens}: MISMATCH with SGLang's own "
                f"capture: " + " | ".join(mismatches) + ". This forward was served SGLang's "
                f"values; switching this server back to SGLang's own capture (every TP rank)",
                True)
            self.disable("self-check mismatch")
            return
        if peer_mismatch:
            log(f"eagle_capture verify {step}: another TP rank's capture differed from SGLang's "
                f"own (its log names the layer); switching back to SGLang's own capture with it",
                True)
            self.disable("self-check mismatch on another TP rank")
            return
        log(f"eagle_capture verify {step}: T={num_tokens}, layers {self.layer_ids}: captures "
            f"bit-identical to SGLang's own, normed output within "
            f"{self.verify_norm_dev:.3g} of SGLang's norm, {tp_note}", False)
        if self.verify_left == 0:
            log(f"eagle_capture verify: {self.verified_forwards} forwards checked, all equal to "
                f"SGLang's own capture; self-check off", False)

    def disable(self, reason: str) -> None:
        """Switch back to SGLang's own capture for every later forward."""
        self.disabled = True
        self.verify_left = 0
        lm = self._causal_lm
        if lm is not None:
            lm.model.layers_to_capture = list(self.sglang_layers)
            lm.capture_aux_hidden_states = True
        if self.graph_captured:
            _log().error(
                "eagle_capture: switched back to SGLang's own capture (%s) for eager forwards; "
                "CUDA graphs captured at start-up still replay the fused capture. The target "
                "still verifies every draft token (outputs stay correct), but acceptance may "
                "drop: restart with EAGLE_CAPTURE=0", reason)


def _deviation(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool]:
    """The largest deviation of ``got`` from ``ref``, and whether some element is
    further than the self-check's rounding tolerance (relative, per dtype)."""
    dev = (got.float() - ref.float()).abs()
    rtol = VERIFY_NORM_RTOL.get(got.dtype, 2.0 ** -6)
    return dev.max().item(), (dev - rtol * ref.float().abs()).max().item() > rtol


def _log():
    import logging
    return logging.getLogger("eagle_capture")


def _flashinfer_allreduce_unavailable() -> Optional[bool]:
    fn = getattr(sys.modules.get("sglang.srt.layers.flashinfer_comm_fusion"),
                 "is_flashinfer_allreduce_unavailable", None)
    try:
        return bool(fn()) if fn is not None else None
    except Exception:  # noqa: BLE001
        return None


def _capturing_cuda_graph(like: torch.Tensor) -> bool:
    return like.is_cuda and torch.cuda.is_current_stream_capturing()


def _in_compiled_region() -> bool:
    """Whether SGLang is running the piecewise-compiled layer loop now (its
    compiled code does not rerun our norms' Python)."""
    compile_module = sys.modules.get("sglang.srt.compilation.compile")
    # The trampoline's own switch: the _COMPILE_ENABLED context variable in 0.5.9,
    # is_in_piecewise_cuda_graph() in 0.5.13, is_in_tc_piecewise_cuda_graph() from 0.5.18.
    flag = (getattr(compile_module, "is_in_tc_piecewise_cuda_graph", None)
            or getattr(compile_module, "is_in_piecewise_cuda_graph", None)
            or getattr(getattr(compile_module, "_COMPILE_ENABLED", None), "get", None))
    try:
        return bool(flag()) if flag is not None else False
    except Exception:  # noqa: BLE001 - a flag we cannot read is "not compiled"
        return False


def _batch_invariant_mode(norm: torch.nn.Module) -> bool:
    """SGLang's batch-invariant mode routes residual norms to forward_native;
    keep its own path there (read from the norm's module, as layernorm.py does)."""
    flag = getattr(sys.modules.get(type(norm).__module__), "is_batch_invariant_mode_enabled", None)
    return bool(flag()) if flag is not None else False


class _CapturingNormMixin:
    """Methods of the capturing subclass; ``_eagle_capture`` (state) and
    ``_eagle_layer_id`` are set on the instance at install."""

    def _eagle_fusable(self, x, residual, post_residual_addition, extra) -> bool:
        """The plain fused_add_rmsnorm case our kernel reproduces; anything else
        (SGLang's special norms and modes) runs SGLang's own code."""
        return (residual is not None and not extra and x.dim() == 2 and residual.dim() == 2
                and x.dtype == residual.dtype and x.shape == residual.shape
                and x.stride(-1) == 1 and residual.stride(-1) == 1
                and (post_residual_addition is None or post_residual_addition.shape == x.shape)
                and getattr(self, "has_weight", True)
                and getattr(self, "variance_size_override", None) is None
                and not getattr(self, "cast_x_before_out_mul", False)
                and not getattr(self, "fp32_residual", False)
                and getattr(self, "override_orig_dtype", None) is None
                and not getattr(self, "x_pad_to_multiple", 0)
                and self.weight.shape == (x.shape[1],)
                and not _batch_invariant_mode(self))

    def _eagle_store(self, value: torch.Tensor, fused: bool) -> None:
        state = self._eagle_capture
        buffer = state.buffer_for(value.shape[0])
        ops.add_capture(value, None, buffer.aux, buffer.slot_of(self._eagle_layer_id))
        state.record(self._eagle_layer_id, value.shape[0], fused, value)
        if state.verifying(value):   # a copy of SGLang's own residual: compare the slot
            state.verify_layer(self._eagle_layer_id, buffer, value.shape[0], value)

    def forward(self, x, residual=None, post_residual_addition=None, **kwargs):
        state = self._eagle_capture
        if (state.in_allreduce_fusion == self._eagle_layer_id and not state.fallback_reduces
                and residual is not None and torch.version.hip is None):
            # SGLang <= 0.5.20's fallback after FlashInfer declined: x is still this
            # rank's partial sum (only its ROCm aiter route reduces first). Reduce
            # it as the fusion would have, so that neither the capture nor the
            # layer sees the unreduced value.
            x = allreduce.fallback_all_reduce(x, state.fusion_group_arg)
            if not torch.compiler.is_compiling():
                state.reduced_on_decline += 1
        if state.disabled:   # switched back to SGLang's own capture
            return super().forward(x, residual, post_residual_addition, **kwargs)
        if self._eagle_layer_id in state.scattered_layers and residual is not None:
            # This rank holds its slice of the rows: SGLang's own norm on it, then
            # the new residual gathered over the attention-TP group, in rank order
            # (what SGLang's capture gathers), and stored into the slot.
            out = super().forward(x, residual, post_residual_addition, **kwargs)
            self._eagle_store(_attention_tp_gather(out[1]), fused=False)
            if not torch.compiler.is_compiling() and not _capturing_cuda_graph(x):
                state.gathered_calls += 1   # counted as record() counts the others
            return out
        if not self._eagle_fusable(x, residual, post_residual_addition,
                                   [v for v in kwargs.values() if v is not None]):
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
        reference = (super().forward(x.clone(), residual.clone())
                     if post_residual_addition is None and state.verifying(x) else None)
        if post_residual_addition is not None:
            # SGLang adds it to the residual first, out of place (forward_cuda):
            # h + (r + p); the caller's residual is left as it was.
            residual = residual + post_residual_addition
        num_tokens = x.shape[0]
        if state.in_allreduce_fusion == self._eagle_layer_id:
            state.stored_in_fusion = True   # SGLang's fallback after its own all-reduce
        buffer = state.buffer_for(num_tokens)
        slot = buffer.slot_of(self._eagle_layer_id)
        in_slot = (state.residual_in_slot_enabled and num_tokens > state.residual_in_slot_above
                   and not torch.compiler.is_compiling())
        if in_slot:
            # Path f: the new residual is written once, into the slot, and handed
            # on as the residual; the incoming one is dead from here (SGLang would
            # overwrite it in place) and becomes the post norm's output.
            state.check_slot_residual_consumed()
            ops.add_rmsnorm_into_slot(x, residual, self.weight, self.variance_epsilon,
                                      buffer.aux, slot, norm_fp32_sum=True)
            new_residual = buffer.aux[:num_tokens, slot]
            state.residual_in_slot = _SlotResidual(self._eagle_layer_id, new_residual, residual)
            state.slot_residual_calls += 1
        else:
            ops.add_rmsnorm_capture(x, residual, self.weight, self.variance_epsilon,
                                    buffer.aux, slot, norm_fp32_sum=True)
            new_residual = residual
        state.record(self._eagle_layer_id, num_tokens, True, x)
        if reference is not None:
            ref_x, ref_r = reference
            # A mismatch writes SGLang's residual into the slot (path f's residual).
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
        if (reducer is not None and post_residual_addition is None
                and self._eagle_fusable(x, residual, None, []) and reducer.takes(x)):
            path = reducer.path_for(x.shape[0])
            if path != allreduce.ENGINE_FUSION:
                return self._eagle_reduce_add_rmsnorm(reducer, path, x, residual)
        eager = not torch.compiler.is_compiling()
        unavailable = _flashinfer_allreduce_unavailable() if eager else None
        if eager:
            # When FlashInfer declines, SGLang calls this norm's forward() (our
            # capturing one, after an all-reduce from 0.5.22; before that, forward()
            # reduces first): it then stores the capture itself.
            state.in_allreduce_fusion = self._eagle_layer_id
            state.fusion_group_arg = _use_attn_tp_group_arg(
                super().forward_with_allreduce_fusion, args, kwargs)
            state.stored_in_fusion = False
        try:
            out = super().forward_with_allreduce_fusion(x, residual, *args, **kwargs)
        finally:
            if eager:
                state.in_allreduce_fusion = None
        if eager and unavailable is False and _flashinfer_allreduce_unavailable() \
                and not state.fallback_reduces:
            _log().error(
                "eagle_capture: SGLang's FlashInfer all-reduce fusion could not set up its "
                "workspace in this forward (layer %d): SGLang <= 0.5.20 then runs its norms on "
                "the per-rank partial sums. The captured layers reduced first; the other layers "
                "of this forward (and SGLang's own capture) are not reduced. Later forwards "
                "take SGLang's explicit all-reduce", self._eagle_layer_id)
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
        if state.verifying(x):   # SGLang's all-reduce and norm on copies
            reference = super().forward(reducer.reduce(x.clone()), residual.clone())
        if path == allreduce.ONE_SHOT:
            reducer.one_shot.reduce_add_rmsnorm(x, residual, self.weight, self.variance_epsilon,
                                                buffer.aux, slot, norm_fp32_sum=True)
        else:
            x = reducer.reduce(x)
            ops.add_rmsnorm_capture(x, residual, self.weight, self.variance_epsilon, buffer.aux,
                                    slot, norm_fp32_sum=True)
        state.record(self._eagle_layer_id, num_tokens, True, x)
        if not torch.compiler.is_compiling() and not _capturing_cuda_graph(x):
            reducer.calls[path] += 1
        if reference is not None:
            ref_x, ref_r = reference
            # The one kernel sums the partials in fp32 in rank order, SGLang's
            # all-reduce in its own order and dtype: equal up to rounding there.
            exact = path != allreduce.ONE_SHOT
            if not state.verify_layer(self._eagle_layer_id, buffer, num_tokens, ref_r, x, ref_x,
                                      residual_exact=exact):
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


class _SlotResidual(NamedTuple):
    """A captured layer's residual left in its aux slot by the input norm (path f)."""
    layer_id: int
    view: torch.Tensor    # aux[:T, slot]: the residual the layer's stages see
    spare: torch.Tensor   # the input norm's incoming residual, dead: the post norm's output


class _SlotResidualPostNormMixin:
    """The post-attention norm of a captured layer under path f: its residual is
    the slot, which SGLang's in-place fused_add_rmsnorm would overwrite with the
    next residual. It writes that one into the spare tensor instead (one fused
    add + RMSNorm, out of place), so the capture stays and the layer's output
    residual is bit-identical to SGLang's. ``_eagle_capture`` and
    ``_eagle_layer_id`` are set on the instance at install."""

    def _eagle_take_slot(self, residual) -> Optional[torch.Tensor]:
        """The spare to write into when ``residual`` is this layer's slot, else None."""
        state = self._eagle_capture
        pending = state.residual_in_slot
        if (pending is None or pending.layer_id != self._eagle_layer_id
                or residual is not pending.view):
            return None
        state.residual_in_slot = None
        return pending.spare

    def forward(self, x, residual=None, post_residual_addition=None, **kwargs):
        spare = self._eagle_take_slot(residual)
        if spare is None:
            return super().forward(x, residual, post_residual_addition, **kwargs)
        if _CapturingNormMixin._eagle_fusable(self, x, residual, post_residual_addition,
                                              [v for v in kwargs.values() if v is not None]) \
                and post_residual_addition is None and spare.shape == x.shape \
                and spare.dtype == x.dtype and spare.is_contiguous():
            ops.add_rmsnorm_out(x, residual, self.weight, self.variance_epsilon, spare,
                                norm_fp32_sum=True)
            return x, spare
        # Any other norm path: SGLang's own code, on the spare holding a copy.
        spare.copy_(residual)
        return super().forward(x, spare, post_residual_addition, **kwargs)

    def forward_with_allreduce_fusion(self, x, residual, *args, **kwargs):
        # FlashInfer's fusion reads the residual and writes a fresh residual_out,
        # but declines a strided one: hand it the spare holding a copy (the
        # install keeps path f to forwards the fusion does not take).
        spare = self._eagle_take_slot(residual)
        if spare is not None:
            spare.copy_(residual)
            residual = spare
        return super().forward_with_allreduce_fusion(x, residual, *args, **kwargs)


@functools.lru_cache(maxsize=None)
def _with_mixin(mixin: type, cls: type) -> type:
    """``cls`` with ``mixin``'s methods first in the MRO: same name and module,
    ``isinstance`` of ``cls`` still holds (one class per pair, so repeated
    installs share it)."""
    return type(cls.__name__, (mixin, cls),
                {"__module__": cls.__module__,
                 "__qualname__": f"{cls.__qualname__}[eagle_capture]"})


class _CapturingLogitsMixin:
    def forward(self, input_ids, hidden_states, lm_head, logits_metadata,
                aux_hidden_states=None, *args, **kwargs):
        state = self._eagle_capture
        if state.disabled:   # SGLang's own capture is back on: pass its aux through
            return super().forward(input_ids, hidden_states, lm_head, logits_metadata,
                                   aux_hidden_states, *args, **kwargs)
        if aux_hidden_states is not None:
            raise RuntimeError("eagle_capture: the model handed the LogitsProcessor its own aux "
                               "hidden states: set_eagle3_layers_to_capture was called again "
                               "after install_eagle3_capture; install again after it")
        num_tokens = hidden_states.shape[0]
        state.check_complete(num_tokens)
        buffer = state.buffer_for(num_tokens)
        state.overflow = None   # the view below keeps a per-forward buffer alive
        # An idle rank (DP attention: no requests of its own) still joins the
        # self-check's collectives; a single process has nothing to check then.
        if state.verifying(hidden_states) and (num_tokens or state.verify_group is not None):
            state.finish_verified_forward(buffer, num_tokens)
        packed = buffer.result(num_tokens)
        if state.copy_out:
            packed = packed.clone()
        aux_hidden_states = packed if state.packed_tensor else [packed]
        return super().forward(input_ids, hidden_states, lm_head, logits_metadata,
                               aux_hidden_states, *args, **kwargs)


def _input_norm(layer: torch.nn.Module, layer_id: int) -> tuple[torch.nn.Module, str]:
    """The captured layer's input norm and the surface it was found on."""
    norm = getattr(layer, "input_layernorm", None)
    comm = getattr(layer, "layer_communicator", None)
    boundary = getattr(layer, "attn_boundary", None)
    if comm is not None:
        surface, held = "layer_communicator (SGLang 0.5.9 - 0.5.20)", getattr(comm, "input_layernorm", None)
    elif boundary is not None:
        surface = "attn_boundary (SGLang 0.5.22 - 0.5.23)"
        held = getattr(getattr(boundary, "plan", None), "norm", None)
    else:
        raise TypeError(f"eagle_capture: decoder layer {layer_id} ({type(layer).__name__}) has "
                        f"neither layer_communicator (SGLang <= 0.5.20) nor attn_boundary "
                        f"(SGLang 0.5.22 - 0.5.23): unsupported SGLang version")
    if norm is None or held is not norm:
        raise TypeError(f"eagle_capture: layer {layer_id}'s {surface.split()[0]} calls another "
                        f"input norm than layer.input_layernorm; unsupported SGLang version")
    for attr in ("weight", "variance_epsilon", "forward_native"):
        if not hasattr(norm, attr):
            raise TypeError(f"eagle_capture: layer {layer_id}'s input norm "
                            f"({type(norm).__name__}) has no {attr!r}: not SGLang's RMSNorm")
    return norm, surface


def _post_attention_norm(layer: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The captured layer's post-attention norm, if every surface SGLang calls it
    through holds the same RMSNorm (else path f stays off for the layer)."""
    norm = getattr(layer, "post_attention_layernorm", None)
    comm = getattr(layer, "layer_communicator", None)
    boundary = getattr(layer, "ffn_boundary", None) or getattr(layer, "mlp_boundary", None)
    if comm is not None:
        held = getattr(comm, "post_attention_layernorm", None)
    elif boundary is not None:
        held = getattr(getattr(boundary, "plan", None), "norm", None)
    else:
        return None
    if norm is None or held is not norm or not all(
            hasattr(norm, a) for a in ("weight", "variance_epsilon", "forward_native")):
        return None
    return norm


def _allreduce_fusion_max_tokens() -> int:
    """The largest forward SGLang's FlashInfer all-reduce + add + RMSNorm fusion
    may take at a post-attention norm (its FUSE_ALLREDUCE_MAX_BATCH_SIZE, read
    where the running line defines it); 0 at tensor-parallel size 1. Whether the
    fusion is on is not read: a forward it does not take only loses path f."""
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_world_size
        tp = get_tensor_model_parallel_world_size()
    except Exception:  # noqa: BLE001 - not an SGLang process (or not initialised)
        return 0
    if tp <= 1:
        return 0
    for name in ("sglang.srt.layers.communicator", "sglang.srt.layers.layer_boundary"):
        limit = getattr(sys.modules.get(name), "FUSE_ALLREDUCE_MAX_BATCH_SIZE", None)
        if isinstance(limit, int):
            return limit
    return 2048   # the value of every line read (0.5.9 - 0.5.23)


def _server_args():
    """SGLang's server arguments where this version exposes them (the accessor
    moved: ``runtime_context.get_server_args`` in 0.5.22+, before that
    ``server_args.get_global_server_args``); None outside a server."""
    for module_name, getter in (("sglang.srt.runtime_context", "get_server_args"),
                                ("sglang.srt.server_args", "get_global_server_args")):
        fn = getattr(sys.modules.get(module_name), getter, None)
        if fn is None:
            continue
        try:
            args = fn()
        except Exception:  # noqa: BLE001 - retired or not initialised
            continue
        if args is not None:
            return args
    return None


def _runtime_modes() -> dict:
    """The modes SGLang's model runner really set up, from its own runtime helpers
    (every line 0.5.9 - 0.5.23): from 0.5.20 the server-args record keeps only the
    command line, so auto-enabled modes (DeepSeek-V3.2's prefill context
    parallelism turning on DP attention and DeepEP, say) are missing there."""
    def call(module_name, fn_name):
        fn = getattr(sys.modules.get(module_name), fn_name, None)
        try:
            return fn() if fn is not None else None
        except Exception:  # noqa: BLE001 - not initialised in this process
            return None

    a2a = call("sglang.srt.layers.moe.utils", "get_moe_a2a_backend")
    is_none = getattr(a2a, "is_none", None)
    parallel = call("sglang.srt.runtime_context", "get_parallel")
    return {
        "enable_dp_attention": call("sglang.srt.layers.dp_attention", "is_dp_attention_enabled"),
        "enable_two_batch_overlap": call("sglang.srt.layers.moe.utils", "is_tbo_enabled"),
        "moe_a2a_backend": None if is_none is None or is_none() else getattr(a2a, "value", a2a),
        # 0.5.9 / 0.5.13 have the helper; 0.5.20+ only the parallel context.
        "attn_cp_size": next((v for v in (call("sglang.srt.layers.dp_attention",
                                               "get_attention_cp_size"),
                                          getattr(parallel, "attn_cp_size", None))
                              if v is not None), None),
        "enable_layernorm_sp": getattr(parallel, "enable_layernorm_sp", None),
    }


def _attention_tp_size() -> Optional[int]:
    """The attention-TP group's size (SGLang's ``get_attn_tp_group``, every line
    0.5.9 - 0.5.23: the TP group without DP attention, tp_size / dp_size with
    it); 1 outside a distributed SGLang process; None if it cannot be read."""
    ps = sys.modules.get("sglang.srt.distributed.parallel_state")
    if ps is None:
        return 1
    try:
        return int(ps.get_attn_tp_group().world_size)
    except Exception:  # noqa: BLE001 - groups not initialised: a single process
        initialised = getattr(ps, "model_parallel_is_initialized", None)
        try:
            return None if initialised is not None and initialised() else 1
        except Exception:  # noqa: BLE001
            return None


def _scattered_captures(model: torch.nn.Module, layer_ids: list[int]) -> frozenset:
    """Captured layers whose input rows are token-scattered over the attention-TP
    group, as SGLang lays them out: <= 0.5.20 its own ``layer_scatter_modes``
    (input mode SCATTERED); 0.5.22+ its rule (the previous layer ran its FFN on
    this rank's rows: a sparse layer under an all-to-all MoE backend, a dense one
    with moe_dense_tp_size 1). None with an attention-TP group of one rank. A
    wrong prediction is caught by the completeness check (the rows stored)."""
    if _attention_tp_size() == 1:
        return frozenset()
    moe_utils = sys.modules.get("sglang.srt.layers.moe.utils")
    scattered_fn = getattr(moe_utils, "is_moe_input_scattered_across_dp_ranks", None)
    if scattered_fn is None:
        a2a = getattr(moe_utils, "get_moe_a2a_backend", None)
        scattered_fn = (lambda: not a2a().is_none()) if a2a is not None else (lambda: False)
    args = _server_args()
    dense_on_rank_rows = getattr(args, "moe_dense_tp_size", None) == 1
    out = set()
    for i in layer_ids:
        modes = getattr(getattr(model.layers[i], "layer_communicator", None),
                        "layer_scatter_modes", None)
        if modes is not None:
            if getattr(modes.layer_input_mode, "name", None) == "SCATTERED":
                out.add(i)
            continue
        previous = model.layers[i - 1]
        if (scattered_fn() if getattr(previous, "is_layer_sparse", False)
                else dense_on_rank_rows):
            out.add(i)
    return frozenset(out)


def _ffn_on_rank_rows() -> Optional[str]:
    """Why some layer runs its FFN on this rank's share of the rows (an all-to-all
    MoE backend; moe_dense_tp_size 1), or None: with an attention-TP group of
    several ranks that scatters the rows over it. The backend is read from
    SGLang's runtime first (it may turn one on itself), then the server args."""
    args = _server_args()
    a2a = _runtime_modes().get("moe_a2a_backend")
    if a2a is None and args is not None:
        a2a = getattr(args, "moe_a2a_backend", None)
    reasons = []
    if a2a not in (None, "none"):
        reasons.append(f"an all-to-all MoE (moe_a2a_backend={a2a!r})")
    if args is not None and getattr(args, "moe_dense_tp_size", None) == 1:
        reasons.append("moe_dense_tp_size=1")
    return " and ".join(reasons) or None


def _rows_may_scatter() -> bool:
    return _attention_tp_size() != 1 and _ffn_on_rank_rows() is not None


def _attention_tp_gather(rows: torch.Tensor) -> torch.Tensor:
    """Every attention-TP rank's ``rows`` stacked in rank order, by SGLang's own
    group (``GroupCoordinator.all_gather(dim=0)``: its communicator)."""
    from sglang.srt.distributed.parallel_state import get_attn_tp_group
    return get_attn_tp_group().all_gather(rows.contiguous(), dim=0)


def _dp_attention_enabled() -> bool:
    modes = _runtime_modes()
    if modes.get("enable_dp_attention"):
        return True
    args = _server_args()
    return bool(getattr(args, "enable_dp_attention", False)) if args is not None else False


def _refuse_unsupported_modes() -> None:
    args = _server_args()
    modes = _runtime_modes()

    def mode(name, default):
        runtime = modes.get(name)
        if runtime not in (None, False, default):
            return runtime
        return getattr(args, name, default) if args is not None else default

    refused = []
    if mode("enable_two_batch_overlap", False):
        refused.append("two-batch overlap (enable_two_batch_overlap): the input norm runs on "
                       "half-batches, each of which would overwrite the slot's first rows")
    # DP attention is served: each rank's input norm sees that rank's own (padded)
    # rows, exactly what SGLang captures there and hands that rank's draft. Rows
    # token-scattered over an attention-TP group of several ranks (an all-to-all
    # MoE backend after sparse layers, moe_dense_tp_size 1 after dense ones) are
    # gathered (_scattered_captures), which needs the group's size.
    on_rank_rows = _ffn_on_rank_rows()
    if _attention_tp_size() is None and on_rank_rows:
        refused.append(f"{on_rank_rows} with an attention-TP group whose size cannot be read: "
                       f"the captured rows may be scattered over it")
    cp = mode("attn_cp_size", 1)
    if cp not in (None, 1):
        refused.append(f"context parallelism (attn_cp_size={cp}): each rank holds a slice of "
                       f"the tokens")
    if mode("enable_layernorm_sp", False):
        # SGLang itself refuses it for DeepSeek / Kimi and for any speculative
        # decoding (0.5.20 - 0.5.23); refused here too, should that change.
        refused.append("layernorm sequence parallelism (enable_layernorm_sp): the residual is "
                       "row-sharded over the TP group at the input norm")
    if refused:
        raise UnsupportedServer("eagle_capture: install_eagle3_capture does not support "
                                + "; ".join(refused) + ". Keep SGLang's own capture for this "
                                "server")


def text_model_of(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The DeepseekV2 causal LM inside ``model`` and the attribute path to it:
    the model itself (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``) or
    a wrapper's ``language_model`` (``KimiK25ForConditionalGeneration``, whose
    ``.model`` aliases it)."""
    def looks_like(m) -> bool:
        inner = getattr(m, "model", None)
        return (isinstance(m, torch.nn.Module) and inner is not None
                and hasattr(inner, "layers") and hasattr(inner, "layers_to_capture")
                and hasattr(m, "capture_aux_hidden_states"))

    if looks_like(model):
        return model, ""
    language_model = getattr(model, "language_model", None)
    if looks_like(language_model):
        return language_model, ".language_model"
    found = [name for name, child in model.named_children() if looks_like(child)]
    if found:
        raise TypeError(f"eagle_capture: {type(model).__name__} holds a DeepseekV2 text model at "
                        f".{found[0]}, a wrapper eagle_capture does not know (known: the model "
                        f"itself, .language_model); keep SGLang's own capture")
    raise TypeError(f"eagle_capture: expected SGLang's DeepseekV2ForCausalLM / "
                    f"DeepseekV3ForCausalLM or a wrapper with .language_model (Kimi-K2.5), got "
                    f"{type(model).__name__} (no .model.layers / .model.layers_to_capture)")


def install_eagle3_capture(causal_lm: torch.nn.Module, max_tokens: int, *,
                           allow_embedding: bool = False, residual_in_slot: bool = True,
                           fused_allreduce: bool = False, allreduce_table=None,
                           dtype: Optional[torch.dtype] = None,
                           device: Optional[torch.device] = None) -> AuxCaptureBuffer:
    """Replace SGLang's EAGLE-3 capture in ``causal_lm`` (a ``DeepseekV2ForCausalLM``,
    ``DeepseekV3ForCausalLM`` or ``KimiK25ForConditionalGeneration``) by the fused
    one; returns the buffer (``max_tokens`` rows: the most tokens one forward
    runs, chunked prefill and CUDA-graph batches included; an eager forward with
    more gets a buffer of its own, with a warning).

    Call it where SGLang's model runner has just called
    ``model.set_eagle3_layers_to_capture(...)`` (end of ``load_model``; from 0.5.18
    in ``configure_aux_hidden_state_capture``) and before CUDA graphs are
    captured: a graph captured earlier replays SGLang's own capture. The SGLang
    plugin (:mod:`eagle_capture.integrations.sglang.plugin`) does exactly that.

    ``residual_in_slot`` (path f): where the layer's plain norms run, the input
    norm writes the new residual into the slot only and the post-attention norm
    writes the next one out of place, so the capture costs no extra write (eager
    and CUDA graphs; under torch.compile, and for forwards SGLang's all-reduce
    fusion may take at TP > 1, the residual is stored in place and copied once
    into the slot: path e). False: path e everywhere.

    ``fused_allreduce`` (opt-in): where SGLang would fuse a captured layer's
    deferred all-reduce into its input norm (TP > 1), run the project's one
    kernel or SGLang's all-reduce + the fused op instead of SGLang's fusion +
    a capture copy, per T by ``allreduce_table`` (a :class:`PathTable`, path or
    dict; default ``$EAGLE_CAPTURE_ALLREDUCE_TABLE``): :mod:`.allreduce`.
    Collective on CUDA (a symmetric buffer on every TP rank). Where it does not
    apply (TP 1, DP attention, scattered rows) it logs why and stays off.

    Raises :class:`WrongCaptureLayers` for layer ids SGLang's own capture would
    also get wrong, :class:`UnsupportedServer` for server modes the fused capture
    does not handle, ``TypeError`` for a model it does not know.
    """
    wrapper = causal_lm
    causal_lm, _ = text_model_of(wrapper)
    model = causal_lm.model
    if isinstance(getattr(causal_lm, "_eagle_capture", None), CaptureState):
        raise ValueError("eagle_capture: the fused capture is already installed on this model")
    if not getattr(causal_lm, "capture_aux_hidden_states", False) or not model.layers_to_capture:
        raise ValueError("eagle_capture: EAGLE-3 capture is not enabled on this model; install "
                         "after set_eagle3_layers_to_capture(...) (on the last PP rank)")
    logits = getattr(causal_lm, "logits_processor", None)
    if not isinstance(logits, torch.nn.Module):
        raise TypeError("eagle_capture: the model has no logits_processor module")
    sglang_layers = list(model.layers_to_capture)
    check_capture_layers(sglang_layers, getattr(model, "start_layer", 0),
                          getattr(model, "end_layer", len(model.layers)), allow_embedding)
    layer_ids = sorted(sglang_layers)
    _refuse_unsupported_modes()

    norms, surfaces = [], set()
    for i in layer_ids:
        norm, surface = _input_norm(model.layers[i], i)
        norms.append(norm)
        surfaces.add(surface)
    post_norms = [_post_attention_norm(model.layers[i]) for i in layer_ids]
    weight = norms[0].weight
    buffer = AuxCaptureBuffer(max_tokens, weight.shape[0], layer_ids,
                              dtype=dtype or weight.dtype, device=device or weight.device)
    # Hand the LogitsProcessor what the model itself would have: a packed tensor
    # where the model builds an AuxHiddenStatePacker (0.5.18+), else a list.
    packed_tensor = hasattr(sys.modules.get(type(model).__module__), "AuxHiddenStatePacker")
    state = CaptureState(buffer, layer_ids, surfaces.pop(), packed_tensor,
                         sglang_layers=sglang_layers, causal_lm=causal_lm)

    for i, norm in zip(layer_ids, norms):
        norm.__class__ = _with_mixin(_CapturingNormMixin, type(norm))
        norm._eagle_capture = state
        norm._eagle_layer_id = i
    # Not under DP attention: there SGLang's DP gather reads the residual around
    # the post-attention norm and may call that norm without it (0.5.9, or an
    # attention-TP group of several ranks, where the reduced rows are scattered
    # back into the residual), so the slot could not hand it on. Nor where rows
    # are token-scattered: SGLang then slices the residual around that norm.
    state.scattered_layers = _scattered_captures(model, layer_ids)
    if residual_in_slot and not _dp_attention_enabled() and not _rows_may_scatter() and \
            all(n is not None for n in post_norms):
        for i, norm in zip(layer_ids, post_norms):
            norm.__class__ = _with_mixin(_SlotResidualPostNormMixin, type(norm))
            norm._eagle_capture = state
            norm._eagle_layer_id = i
        state.residual_in_slot_enabled = True
        state.residual_in_slot_above = _allreduce_fusion_max_tokens()
    state.fallback_reduces = allreduce.fallback_reduces()
    if fused_allreduce:
        why = ("the captured layers' rows are token-scattered over the attention-TP group"
               if _rows_may_scatter() else "")
        if not why:
            fusion_rows = _allreduce_fusion_max_tokens() or max_tokens
            state.allreduce, why = allreduce.build(min(max_tokens, fusion_rows), buffer.hidden_size,
                                                   buffer.aux.dtype, buffer.aux.device,
                                                   allreduce_table)
        if state.allreduce is None:
            _log().warning("eagle_capture: the captured layers' fused all-reduce is off (%s): "
                           "SGLang's all-reduce fusion and a capture copy stay there", why)
    logits.__class__ = _with_mixin(_CapturingLogitsMixin, type(logits))
    logits._eagle_capture = state
    # SGLang's own capture off: no add/list (<= 0.5.13), no packer copy (>= 0.5.18).
    model.layers_to_capture = []
    causal_lm.capture_aux_hidden_states = False
    causal_lm._eagle_capture = state
    if wrapper is not causal_lm:
        object.__setattr__(wrapper, "_eagle_capture", state)
    return buffer


def reapply_after_reconfigure(model: torch.nn.Module) -> bool:
    """SGLang called ``set_eagle3_layers_to_capture`` again on an installed
    model (a second ``configure_aux_hidden_state_capture``): turn its own capture
    off again if it asks for the same layers (True), else raise. False when
    nothing is installed."""
    causal_lm, _ = text_model_of(model)
    state = getattr(causal_lm, "_eagle_capture", None)
    if not isinstance(state, CaptureState):
        return False
    if state.disabled:
        return True   # SGLang's own capture on by design (self-check mismatch)
    again = list(causal_lm.model.layers_to_capture)
    if again and sorted(again) != state.layer_ids:
        raise WrongCaptureLayers(
            f"eagle_capture: SGLang set layers_to_capture to {again} after the fused capture "
            f"was installed for {state.layer_ids}; restart the server (the buffer and CUDA "
            f"graphs are built for the first set)")
    causal_lm.model.layers_to_capture = []
    causal_lm.capture_aux_hidden_states = False
    return True


def check_capture_layers(layers: list[int], start: int, end: int,
                          allow_embedding: bool) -> None:
    """Refuse layers_to_capture that would not give the draft K distinct, existing
    layers of this stage."""
    duplicates = sorted({i for i in layers if layers.count(i) > 1})
    if duplicates:
        raise WrongCaptureLayers(
            f"eagle_capture: layers_to_capture {layers} names layer(s) {duplicates} more than "
            f"once (draft ids with a repeated id): the draft expects {len(layers)} distinct "
            f"captures ([T, {len(layers)}*H]); SGLang's own path fails there too (0.5.18+: "
            f"'captured {len(set(layers))} of {len(layers)}'). Fix the draft's "
            f"eagle_aux_hidden_state_layer_ids")
    if min(layers) < 0:
        raise WrongCaptureLayers(
            f"eagle_capture: layers_to_capture holds {min(layers)}: no layer has that index, so "
            f"SGLang never captures it (0.5.13 drops it silently, later lines raise). It comes "
            f"from a draft id of -1 (the embedding output) that this SGLang line does not shift; "
            f"no SpecForge draft is trained on it: fix the draft's "
            f"eagle_aux_hidden_state_layer_ids")
    outside = [i for i in sorted(layers) if not start <= i < end]
    if outside:
        raise WrongCaptureLayers(
            f"eagle_capture: layers {outside} are captured but this rank runs layers "
            f"[{start}, {end}); they would be missing from the draft input")
    if 0 in layers and not allow_embedding:
        raise WrongCaptureLayers(
            "eagle_capture: layer 0 is captured: its input is the embedding output, which no "
            "SpecForge draft is trained on (a draft id of -1, or 0 in the input convention). "
            "Fix the draft's eagle_aux_hidden_state_layer_ids, or pass allow_embedding=True if "
            "the draft really was trained on it")
