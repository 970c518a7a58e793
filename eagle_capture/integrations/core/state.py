"""The capture state both engines' capturing norms share: the persistent buffer,
the rows each captured layer stored in the current eager forward (the completeness
check), the buffer of one oversized eager forward, the residual left in a slot
(the residual-in-slot path), and the live self-check's bookkeeping. Each engine subclasses it with
what its loop needs (``integrations/<engine>/state.py``) and words its own
messages."""

from typing import NamedTuple, Optional

import torch

from eagle_capture.buffer import AuxCaptureBuffer

__all__ = ["CaptureState", "SlotResidual"]


class SlotResidual(NamedTuple):
    """A captured layer's residual left in its aux slot by the input norm (the
    residual-in-slot path)."""

    layer_id: int
    view: torch.Tensor  # aux[:T, slot]: the residual the layer's stages see
    spare: torch.Tensor  # the input norm's incoming residual, dead: the post norm's output


class CaptureState:
    """What every engine's capturing norms and model share."""

    def __init__(self, buffer: AuxCaptureBuffer) -> None:
        self.buffer = buffer  # its layer_ids: the captured layers, ascending
        self.stored_rows: dict[int, int] = {}
        self.fused_calls = 0  # captures done by our fused kernel (tests count these)
        self.overflow_forwards = 0  # eager forwards larger than the buffer
        self.slot_residual_calls = 0  # input norms that left the residual in the slot
        self.disabled = False  # switched back to the engine's own capture
        # Live self-check (EAGLE_CAPTURE_VERIFY=N): compare with the engine's own.
        self.verify_left = 0
        self.verify_total = 0
        self.verified_forwards = 0
        self.verify_mismatches: list[str] = []
        self.verify_norm_dev = 0.0

    def buffer_of(
        self, num_tokens: int, current: Optional[AuxCaptureBuffer]
    ) -> tuple[AuxCaptureBuffer, bool]:
        """The buffer of an eager forward of ``num_tokens`` tokens, more than the
        persistent buffer's rows: ``current`` where it has exactly those rows, else a
        new one (True: allocated now, counted in ``overflow_forwards``), as the
        engines' own capture allocates one per forward."""
        if current is not None and current.max_tokens == num_tokens:
            return current, False
        self.overflow_forwards += 1
        return AuxCaptureBuffer(
            num_tokens,
            self.buffer.hidden_size,
            self.buffer.layer_ids,
            dtype=self.buffer.aux.dtype,
            device=self.buffer.aux.device,
        ), True

    def incomplete(self, stored: dict[int, int], num_tokens: int) -> dict[int, Optional[int]]:
        """The captured layers that did not store ``num_tokens`` rows in this forward:
        layer -> the rows it stored (None: nothing)."""
        return {
            layer: stored.get(layer)
            for layer in self.buffer.layer_ids
            if stored.get(layer) != num_tokens
        }

    def start_verify(self, forwards: int) -> None:
        """Self-check the next ``forwards`` eager forwards."""
        self.verify_left = self.verify_total = forwards

    def take_verified_forward(self) -> list[str]:
        """One verified forward done: its mismatches (the list starts empty again)."""
        self.verify_left -= 1
        self.verified_forwards += 1
        mismatches, self.verify_mismatches = self.verify_mismatches, []
        return mismatches

    def switch_back(self) -> None:
        """The engine's own capture for every later forward (no more self-checks)."""
        self.disabled = True
        self.verify_left = 0
