"""The capture state one model's capturing norms and logits processor share (the
shared core's, :mod:`eagle_capture.integrations.core.state`, with what SGLang's
loops need): the buffer, the captured layers, the completeness check of every eager
forward, the overflow buffer and the live self-check (``EAGLE_CAPTURE_VERIFY``).
Family-neutral: nothing here knows which SGLang model it serves."""

from typing import Optional

import torch

from eagle_capture.buffer import AuxCaptureBuffer
from eagle_capture.integrations.core import log as core_log
from eagle_capture.integrations.core import state as core
from eagle_capture.integrations.core.errors import WrongCaptureLayers
from eagle_capture.integrations.core.selfcheck import beyond_rounding, norm_rtol
from eagle_capture.integrations.core.state import SlotResidual
from eagle_capture.integrations.sglang.server_modes import capturing_cuda_graph, in_compiled_region

__all__ = ["CaptureState", "SlotResidual", "WrongCaptureLayers", "logger"]


class CaptureState(core.CaptureState):
    """What the capturing norms and logits processor of one model share: the
    buffer, the captured layers, the rows each layer stored in the current
    eager forward (for the completeness check), and the live self-check."""

    def __init__(
        self,
        buffer: AuxCaptureBuffer,
        layer_ids: list[int],
        surface: str,
        packed_tensor: bool,
        *,
        sglang_layers: list[int],
        causal_lm: Optional[torch.nn.Module] = None,
        family=None,
    ) -> None:
        super().__init__(buffer)
        self.layer_ids = layer_ids
        self.surface = surface
        self.packed_tensor = packed_tensor  # hand the LogitsProcessor a tensor (>= 0.5.18)
        self.sglang_layers = list(sglang_layers)  # SGLang's layers_to_capture, to switch back
        self._causal_lm = causal_lm
        self.family = family  # its adapter switches SGLang's own capture back on
        self.fallback_calls = 0  # SGLang's own norm path + a slot store
        # A forward with more tokens than the buffer has rows (eager only): a buffer
        # for that forward alone, as SGLang's own capture allocates one per forward.
        self.overflow: Optional[AuxCaptureBuffer] = None
        self.graph_captured = False  # a CUDA graph was captured with our capture in it
        # The live self-check across ranks (the counters are the core's).
        self.verify_group = None  # TP process group: every rank takes one decision
        self.verify_rows_group = None  # ranks holding the same rows (attention TP): compared
        self.copy_out = False  # hand the LogitsProcessor a copy (return_hidden_states)
        self.in_allreduce_fusion = None  # layer inside forward_with_allreduce_fusion (eager)
        self.stored_in_fusion = False  # ... whose fallback already stored the capture
        self.fusion_group_arg = None  # ... and its use_attn_tp_group (None: 0.5.9's TP)
        # Whether SGLang's fusion all-reduces before its fallback norm when FlashInfer
        # declines (0.5.21+); where not, the captured norm reduces first.
        self.fallback_reduces = True
        self.reduced_on_decline = 0
        # The captured layers' all-reduce when SGLang would fuse it
        # (EAGLE_CAPTURE_FUSED_ALLREDUCE=1; allreduce.CapturedLayerAllReduce).
        self.allreduce = None
        # The residual-in-slot path (the residual itself lives in the slot; no
        # extra write): off until install finds the captured layers'
        # post-attention norms. Its input norm
        # takes it for forwards above ``residual_in_slot_above`` tokens (at TP > 1,
        # SGLang's FlashInfer all-reduce fusion takes smaller ones and wants a
        # contiguous residual), and leaves ``residual_in_slot`` for the post norm.
        self.residual_in_slot_enabled = False
        self.residual_in_slot_above = 0
        self.residual_in_slot: Optional[SlotResidual] = None
        # Captured layers whose input rows are token-scattered over the attention-TP
        # group (its slice on each rank): captured gathered.
        self.scattered_layers: frozenset = frozenset()
        self.gathered_calls = 0

    def buffer_for(self, num_tokens: int) -> AuxCaptureBuffer:
        """The buffer this forward's captures go to."""
        if num_tokens <= self.buffer.max_tokens or torch.compiler.is_compiling():
            return self.buffer
        if capturing_cuda_graph(self.buffer.aux):
            raise ValueError(
                f"eagle_capture: a CUDA graph of {num_tokens} tokens is being captured but the "
                f"aux buffer has {self.buffer.max_tokens} rows: size it for the largest graph "
                f"(the plugin does, from the server's arguments)"
            )
        self.overflow, new = self.buffer_of(num_tokens, self.overflow)
        if new:
            if self.overflow_forwards in (1, 10, 100) or self.overflow_forwards % 1000 == 0:
                logger().warning(
                    "eagle_capture: a forward of %d tokens exceeds the aux buffer's %d rows: its "
                    "captures go to a buffer allocated for this forward (as SGLang's own capture "
                    "does; %d such forwards so far). Raise EAGLE_CAPTURE_MAX_TOKENS to avoid it",
                    num_tokens,
                    self.buffer.max_tokens,
                    self.overflow_forwards,
                )
        return self.overflow

    def record(self, layer_id: int, rows: int, fused: bool, like: torch.Tensor) -> None:
        # Under dynamo (piecewise CUDA graphs, --enable-torch-compile) Python
        # state must not be mutated from traced code; the check is eager-only.
        if torch.compiler.is_compiling():
            return
        if capturing_cuda_graph(like):
            self.graph_captured = True
            return  # the graph runner's forwards are not served; nothing to check
        self.stored_rows[layer_id] = rows
        if fused:
            self.fused_calls += 1
        else:
            self.fallback_calls += 1

    def check_complete(self, num_tokens: int) -> None:
        """Every captured layer stored ``num_tokens`` rows in this forward."""
        stored, self.stored_rows = self.stored_rows, {}
        if torch.compiler.is_compiling() or (not stored and in_compiled_region()):
            return  # compiled region: the norms' Python did not run
        self.check_slot_residual_consumed()
        if num_tokens == 0:
            return  # SGLang skips the norms of an empty (idle) batch: nothing to store
        if not stored and capturing_cuda_graph(self.buffer.aux):
            return
        incomplete = self.incomplete(stored, num_tokens)
        missing = [i for i, n in incomplete.items() if n is None]
        wrong = {i: n for i, n in incomplete.items() if n is not None}
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
                f"SGLang's own capture"
            )

    def check_slot_residual_consumed(self) -> None:
        """A residual left in a slot (the residual-in-slot path) must have been taken by the layer's
        post-attention norm before anything else reads or updates it."""
        pending, self.residual_in_slot = self.residual_in_slot, None
        if pending is not None:
            raise RuntimeError(
                f"eagle_capture: layer {pending.layer_id}'s residual was left in its aux slot "
                f"but its post-attention norm did not take it ({self.surface}): another path "
                f"updates the residual there and would overwrite the capture. Install with "
                f"residual_in_slot=False (EAGLE_CAPTURE_RESIDUAL_IN_SLOT=0)"
            )

    # Live self-check ------------------------------------------------------------

    def verifying(self, like: torch.Tensor) -> bool:
        return (
            self.verify_left > 0
            and not torch.compiler.is_compiling()
            and not capturing_cuda_graph(like)
        )

    def verify_layer(
        self,
        layer_id: int,
        buffer: AuxCaptureBuffer,
        num_tokens: int,
        ref_residual: torch.Tensor,
        normed: Optional[torch.Tensor] = None,
        ref_normed: Optional[torch.Tensor] = None,
        residual_exact: bool = True,
    ) -> bool:
        """Compare one layer's capture (and normed output) with SGLang's own; on a
        mismatch write SGLang's values into the slot and report. True if equal.
        ``residual_exact=False``: the capture within the normed output's rounding
        tolerance (an all-reduce summed in another order than SGLang's)."""
        slot = buffer.slot_of(layer_id)
        got = buffer.aux[:num_tokens, slot]
        problems = []
        if residual_exact and not torch.equal(got, ref_residual):
            bad = (got != ref_residual).any(dim=-1).nonzero().flatten()
            problems.append(
                f"capture differs from SGLang's residual in {bad.numel()} of "
                f"{num_tokens} rows (first row {bad[0].item() if bad.numel() else '?'})"
            )
        if not residual_exact and num_tokens:
            worst, beyond = _deviation(got, ref_residual)
            if beyond:
                problems.append(
                    f"capture differs from SGLang's all-reduced residual by up to "
                    f"{worst:.3g}, more than rounding"
                )
        if normed is not None and num_tokens:
            worst, beyond = _deviation(normed, ref_normed)
            self.verify_norm_dev = max(self.verify_norm_dev, worst)
            if beyond:
                rtol = norm_rtol(normed.dtype)
                problems.append(
                    f"normed output differs from SGLang's norm by up to "
                    f"{worst:.3g} (tolerance {rtol:.3g} relative)"
                )
        if not problems:
            return True
        got.copy_(ref_residual)  # this forward still hands the draft SGLang's value
        if normed is not None:
            normed.copy_(ref_normed)
        self.verify_mismatches.append(f"layer {layer_id} (slot {slot}): " + "; ".join(problems))
        return False

    def finish_verified_forward(self, buffer: AuxCaptureBuffer, num_tokens: int) -> None:
        """After a verified forward: the cross-rank check, one log line, and the
        switch back to SGLang's own capture on a mismatch."""

        def log(text: str, error: bool) -> None:
            (logger().error if error else logger().info)(text)

        mismatches = self.take_verified_forward()
        step = f"{self.verified_forwards}/{self.verify_total}"
        tp_note = "1 rank"
        peer_mismatch = False
        if self.verify_group is not None:
            import torch.distributed as dist

            from eagle_capture.parallel.tp import CaptureConsistencyError, check_capture_consistency

            world = dist.get_world_size(self.verify_group)
            # Every rank takes the same decision (a rank switching back alone would
            # leave its peers in the next forward's collectives by themselves).
            flag = torch.tensor(
                [int(bool(mismatches))], dtype=torch.int32, device=buffer.aux.device
            )
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.verify_group)
            peer_mismatch = bool(flag.item()) and not mismatches
            # Only ranks holding the same rows are compared: under DP attention
            # each attention-TP group serves its own requests.
            rows_group = self.verify_rows_group
            rows_world = dist.get_world_size(rows_group) if rows_group is not None else 1
            same = "TP ranks" if rows_world == world else "attention-TP ranks"
            try:
                if rows_group is None:
                    tp_note = (
                        f"{world} TP ranks with DP attention: each holds its own "
                        f"requests' rows (no two ranks compared)"
                    )
                elif not num_tokens:  # the whole attention-TP group is idle
                    tp_note = "no rows on this rank (idle)"
                else:
                    check_capture_consistency(buffer, num_tokens, buffer.hidden_size, rows_group)
                    tp_note = f"identical on all {rows_world} {same}"
            except CaptureConsistencyError as e:
                tp_note = f"NOT identical across the {rows_world} {same}"
                why = (
                    " Each rank's capture equals SGLang's own there, so SGLang's capture hands "
                    "the draft the same: the deployment itself is inconsistent"
                    if not flag.item()
                    else ""
                )
                log(f"eagle_capture verify {step}: {e}.{why}", True)
        if mismatches:
            log(
                f"eagle_capture verify {step}: T={num_tokens}: MISMATCH with SGLang's own "
                f"capture: " + " | ".join(mismatches) + ". This forward was served SGLang's "
                "values; switching this server back to SGLang's own capture (every TP rank)",
                True,
            )
            self.disable("self-check mismatch")
            return
        if peer_mismatch:
            log(
                f"eagle_capture verify {step}: another TP rank's capture differed from SGLang's "
                f"own (its log names the layer); switching back to SGLang's own capture with it",
                True,
            )
            self.disable("self-check mismatch on another TP rank")
            return
        log(
            f"eagle_capture verify {step}: T={num_tokens}, layers {self.layer_ids}: captures "
            f"bit-identical to SGLang's own, normed output within "
            f"{self.verify_norm_dev:.3g} of SGLang's norm, {tp_note}",
            False,
        )
        if self.verify_left == 0:
            log(
                f"eagle_capture verify: {self.verified_forwards} forwards checked, all equal to "
                f"SGLang's own capture; self-check off",
                False,
            )

    def disable(self, reason: str) -> None:
        """Switch back to SGLang's own capture for every later forward."""
        self.switch_back()
        lm = self._causal_lm
        if lm is not None:
            self.family.engine_capture_on(lm, self.sglang_layers)
        if self.graph_captured:
            logger().error(
                "eagle_capture: switched back to SGLang's own capture (%s) for eager forwards; "
                "CUDA graphs captured at start-up still replay the fused capture. The target "
                "still verifies every draft token (outputs stay correct), but acceptance may "
                "drop: restart with EAGLE_CAPTURE=0",
                reason,
            )


def _deviation(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, bool]:
    """The largest deviation of ``got`` from ``ref``, and whether some element is
    further than the self-check's rounding tolerance (the core's rule)."""
    return (got.float() - ref.float()).abs().max().item(), beyond_rounding(got, ref)


def logger():
    return core_log.logger(core_log.SGLANG_LOGGER)
