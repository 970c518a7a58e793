"""The capture state one vLLM model's capturing norms and the model share (the
shared core's, :mod:`eagle_capture.integrations.core.state`, with what vLLM's loops
need): the buffer and this forward's buffer, the rows each captured layer stored
in the current eager forward, the residual left in a slot (the residual-in-slot path), and the live
self-check. Family-neutral."""

from __future__ import annotations

from typing import Optional

import torch

from eagle_capture.buffer import AuxCaptureBuffer
from eagle_capture.integrations import settings
from eagle_capture.integrations.core import log as core_log
from eagle_capture.integrations.core import state as core
from eagle_capture.integrations.core.state import SlotResidual

__all__ = ["CaptureState", "SlotResidual", "capturing_graph", "log"]


def log():
    """The plugin's logger in vLLM's processes."""
    return core_log.logger(core_log.VLLM_LOGGER)


def capturing_graph(like: torch.Tensor) -> bool:
    return like.is_cuda and torch.cuda.is_current_stream_capturing()


class CaptureState(core.CaptureState):
    """What the capturing norms and the model share: the buffer, the slot of each
    captured layer, the rows each stored in the current eager forward, and the
    self-check."""

    def __init__(
        self, buffer: AuxCaptureBuffer, norm_fp32_sum: bool, provider: str, compiled: bool
    ) -> None:
        super().__init__(buffer)
        self.active = buffer  # this forward's buffer (an overflow one in eager)
        self.norm_fp32_sum = norm_fp32_sum
        self.provider = provider  # vLLM's fused_add_rms_norm implementation we match
        self.compiled = compiled  # the layer loop runs under vLLM's torch.compile
        self.keep_allreduce_fusion = False  # capture after vLLM's norm (keeps_allreduce_fusion)
        # The residual-in-slot path (eager forwards): a captured layer's input norm writes the new
        # residual into its slot only and hands the slot on as the residual; the
        # layer's post-attention norm then writes the next residual into the dead
        # incoming one (``spare``) instead of over the capture.
        self.residual_in_slot = not compiled
        self.pending_slot: Optional[SlotResidual] = None

    def views(self, num_tokens: int) -> list[torch.Tensor]:
        aux = self.active.aux
        return [aux[:num_tokens, k] for k in range(self.active.num_captures)]

    def begin(self, num_tokens: int) -> None:
        """Pick the buffer of a forward of ``num_tokens`` tokens (eager Python)."""
        self.stored_rows = {}
        if num_tokens <= self.buffer.max_tokens:
            self.active = self.buffer
            return
        if self.compiled or capturing_graph(self.buffer.aux):
            raise ValueError(
                f"eagle_capture: a forward of {num_tokens} tokens but the aux buffer has "
                f"{self.buffer.max_tokens} rows, and a compiled or CUDA-graph forward cannot "
                f"take a buffer of its own: raise {settings.MAX_TOKENS} to vLLM's "
                f"max_num_batched_tokens or more"
            )
        self.active, new = self.buffer_of(num_tokens, self.active)
        if new:
            log().warning(
                "eagle_capture: a forward of %d tokens exceeds the aux buffer's %d "
                "rows: its captures go to a buffer of its own (%d such forwards)",
                num_tokens,
                self.buffer.max_tokens,
                self.overflow_forwards,
            )

    def check_slot_consumed(self) -> None:
        """A residual left in a slot (the residual-in-slot path) must have been taken by its layer's
        post-attention norm before anything else updates it."""
        pending, self.pending_slot = self.pending_slot, None
        if pending is not None:
            raise RuntimeError(
                f"eagle_capture: layer {pending.layer_id}'s residual was left in its aux slot "
                f"but its post-attention norm never took it: this model's layer does something "
                f"else between its two norms than the loops the plugin was built on"
            )

    def check_complete(self, num_tokens: int) -> None:
        """Every captured layer stored ``num_tokens`` rows in this eager forward."""
        self.check_slot_consumed()
        wrong = self.incomplete(self.stored_rows, num_tokens)
        if wrong:
            raise RuntimeError(
                f"eagle_capture: in a forward of {num_tokens} tokens the captured layers "
                f"stored {wrong} rows (layer: rows; None = not captured): the draft would get "
                f"stale rows. Was the model's layer loop or a norm replaced after the install?"
            )
