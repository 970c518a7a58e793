"""A preallocated ``[max_tokens, K, H]`` aux-hidden-state buffer.

Memory layout: a row-major ``[max_tokens, K, H]`` tensor is the same memory as
``[max_tokens, K*H]``, so ``aux[:T].view(T, K*H)`` *is* the ``torch.cat`` the
EAGLE-3 draft consumes -- returned as a view, never a copy. Keeping H in the
shape turns a TP-local (H / tp) capture or a wrong width into a shape error.

Slots follow ascending layer order, the order SGLang's loop appends in (not
the order of the config list).
"""

from typing import Iterable, Optional

import torch

from eagle_capture import ops
from eagle_capture.layer_ids.validate import check_capture_layers


class AuxCaptureBuffer:
    """Owns the aux buffer and maps captured layer ids to slots.

    ``layer_ids`` are the layers at whose *start* the capture is taken (SGLang's
    ``layers_to_capture``: the input to layer i = the output of layer i - 1).
    """

    def __init__(
        self,
        max_tokens: int,
        hidden_size: int,
        layer_ids: Iterable[int],
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: Optional[torch.device | str] = None,
    ) -> None:
        # The one validation every caller shares (eagle_capture.layer_ids.validate).
        ids = check_capture_layers(layer_ids)
        if max_tokens <= 0 or hidden_size <= 0:
            raise ValueError(
                f"eagle_capture: max_tokens ({max_tokens}) and hidden_size "
                f"({hidden_size}) must be positive"
            )
        self.layer_ids: tuple[int, ...] = tuple(ids)
        self._slot_of = {layer: slot for slot, layer in enumerate(self.layer_ids)}
        self.max_tokens = int(max_tokens)
        self.hidden_size = int(hidden_size)
        self.aux = torch.empty(
            self.max_tokens, len(self.layer_ids), self.hidden_size, dtype=dtype, device=device
        )

    @property
    def num_captures(self) -> int:
        return len(self.layer_ids)

    def captures_layer(self, layer_id: int) -> bool:
        return layer_id in self._slot_of

    def slot_of(self, layer_id: int) -> int:
        try:
            return self._slot_of[layer_id]
        except KeyError:
            raise KeyError(
                f"eagle_capture: layer {layer_id} is not captured; captured layers "
                f"are {list(self.layer_ids)}"
            ) from None

    def _check_tokens(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self.max_tokens:
            raise ValueError(
                f"eagle_capture: {num_tokens} tokens do not fit the aux buffer of "
                f"{self.max_tokens} rows"
            )

    def slot_view(self, layer_id: int, num_tokens: int) -> torch.Tensor:
        """``aux[:T, slot]``: the ``[T, H]`` capture of one layer (row stride K*H)."""
        self._check_tokens(num_tokens)
        return self.aux[:num_tokens, self.slot_of(layer_id)]

    # Captures -----------------------------------------------------------------

    def capture(
        self, layer_id: int, hidden_states: torch.Tensor, residual: Optional[torch.Tensor]
    ) -> None:
        """Store ``hidden_states + residual`` (SGLang's capture at the start of layer_id)."""
        ops.add_capture(hidden_states, residual, self.aux, self.slot_of(layer_id))

    def add_rmsnorm_capture(
        self,
        layer_id: int,
        hidden_states: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> None:
        """Layer ``layer_id``'s in-place input add+RMSNorm, also storing its residual."""
        ops.add_rmsnorm_capture(
            hidden_states, residual, weight, eps, self.aux, self.slot_of(layer_id)
        )

    # Result -------------------------------------------------------------------

    def result(self, num_tokens: int) -> torch.Tensor:
        """The ``[T, K*H]`` concatenation, as a view of the buffer (no copy)."""
        self._check_tokens(num_tokens)
        return self.aux[:num_tokens].view(num_tokens, self.num_captures * self.hidden_size)

    def __repr__(self) -> str:
        return (
            f"AuxCaptureBuffer(max_tokens={self.max_tokens}, hidden_size={self.hidden_size}, "
            f"layer_ids={list(self.layer_ids)}, dtype={self.aux.dtype}, "
            f"device={self.aux.device})"
        )
