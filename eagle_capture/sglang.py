"""Drop-in adapters for SGLang's DeepseekV2 model (DeepSeek-V3, Kimi-K2/K2.5).

Each adapter touches only the attributes and calls named here (read from the
sglang wheels, FACTS.md section 2); everything else of the model is left as
it is. SGLang cannot be installed on our machines, so the tests run them
against a faithful mirror of exactly that surface (tests/sglang_mirror.py).

Classic loop, SGLang <= 0.5.13 -- :func:`install_classic_capture`
    ``DeepseekV2Model.forward`` appends ``hidden_states + residual`` for each
    ``i in self.layers_to_capture`` and returns ``(hidden_states, aux_list)``;
    ``LogitsProcessor`` concatenates the list. The adapter swaps each captured
    layer's ``input_layernorm`` for one that stores the new residual into the
    buffer slot from inside the fused add+RMSNorm the layer runs anyway, empties
    ``layers_to_capture`` (no extra add, no list), and makes the model return
    ``[buffer.result(T)]``: the packed ``[T, K*H]`` view. The classic
    ``LogitsProcessor`` still calls ``torch.cat`` on that one-element list,
    which is one copy of ``[T, K*H]``; newer SGLang passes a one-element list
    through unchanged (``pack_aux_hidden_states``).

Packer, SGLang >= 0.5.18 -- :func:`install_packer_capture`
    The layer loop hands layer i an ``AuxHiddenStatePacker`` (sharing the CUDA
    graph runner's ``aux_hidden_states_buffer`` via ``for_batch``) when i is
    captured, and ``LayerCommunicator.prepare_attn_and_capture_last_layer_outputs``
    runs the input add+RMSNorm and then ``packer.append(residual)`` -- a strided
    ``copy_`` at ~40% of the copy roofline (FACTS.md section 4). The adapter
    makes that add+RMSNorm write its residual into the packer's slot directly:
    it takes the slot with ``packer.slot(residual)`` (so ``finalize()``'s count
    check still holds) and runs the fused add+RMSNorm+capture on it.
    Only for plain tensor parallelism, where the capture-point gather is the
    identity; with DP attention or all-to-all MoE the rows must be gathered
    first (the tensor-parallel issue), so pass ``when`` to keep those batches
    on SGLang's own path.
"""

from typing import Callable, Optional

import torch

from . import ops
from .buffer import AuxCaptureBuffer


class CapturingRMSNorm(torch.nn.Module):
    """Stand-in for a captured layer's ``input_layernorm`` (SGLang ``RMSNorm``):
    same weight, same call signature and in-place semantics
    (``forward(x, residual) -> (x, residual)``), plus the capture store."""

    def __init__(self, norm: torch.nn.Module, buffer: AuxCaptureBuffer, layer_id: int) -> None:
        super().__init__()
        self.norm = norm                      # keeps .weight / .variance_epsilon reachable
        self.buffer = buffer
        self.layer_id = layer_id
        self.slot = buffer.slot_of(layer_id)

    @property
    def weight(self) -> torch.Tensor:
        return self.norm.weight

    @property
    def variance_epsilon(self) -> float:
        return self.norm.variance_epsilon

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, *args, **kwargs):
        if args or kwargs:
            raise TypeError("eagle_capture: CapturingRMSNorm supports forward(x, residual) only; "
                            f"got extra arguments {args} {list(kwargs)}")
        if residual is None:
            # Layer 0: the capture is the layer's input (the embedding output).
            self.buffer.capture(self.layer_id, x, None)
            return self.norm(x)
        ops.add_rmsnorm_capture(x, residual, self.norm.weight, self.norm.variance_epsilon,
                                self.buffer.aux, self.slot)
        return x, residual


def install_classic_capture(causal_lm: torch.nn.Module, max_tokens: int, *,
                            dtype: Optional[torch.dtype] = None,
                            device: Optional[torch.device] = None) -> AuxCaptureBuffer:
    """Fused capture for SGLang <= 0.5.13's ``DeepseekV2ForCausalLM``.

    Call after ``causal_lm.set_eagle3_layers_to_capture(...)``. Returns the
    buffer (``max_tokens`` rows: the largest batch the server runs, CUDA-graph
    batches included).
    """
    model = causal_lm.model
    if not getattr(causal_lm, "capture_aux_hidden_states", False):
        raise ValueError("eagle_capture: capture is not enabled on this model; call "
                         "set_eagle3_layers_to_capture(...) first (on the last PP rank)")
    if getattr(model, "_eagle_capture_buffer", None) is not None:
        raise ValueError("eagle_capture: the fused capture is already installed on this model")
    layer_ids = sorted(model.layers_to_capture)
    if not layer_ids:
        raise ValueError("eagle_capture: model.layers_to_capture is empty")
    start = getattr(model, "start_layer", 0)
    end = getattr(model, "end_layer", len(model.layers))
    outside = [i for i in layer_ids if not start <= i < end]
    if outside:
        raise ValueError(f"eagle_capture: layers {outside} are captured but this rank runs "
                         f"layers [{start}, {end}); they would be missing from the draft input")
    first_norm = model.layers[layer_ids[0]].input_layernorm
    weight = first_norm.weight
    buffer = AuxCaptureBuffer(max_tokens, weight.shape[0], layer_ids,
                              dtype=dtype or weight.dtype, device=device or weight.device)
    for i in layer_ids:
        layer = model.layers[i]
        layer.input_layernorm = CapturingRMSNorm(layer.input_layernorm, buffer, i)
    # The loop's own `aux.append(hidden_states + residual)` is no longer needed.
    model.layers_to_capture = []
    model._eagle_capture_buffer = buffer
    inner_forward = model.forward

    def forward(*args, **kwargs):
        hidden_states = inner_forward(*args, **kwargs)
        if isinstance(hidden_states, tuple):  # something else still captured: refuse to mix
            raise RuntimeError("eagle_capture: the model captured through its own list too; "
                               "layers_to_capture was changed after install")
        return hidden_states, [buffer.result(hidden_states.shape[0])]

    model.forward = forward
    return buffer


def _slot_index_and_buffer(packer, residual: torch.Tensor):
    """Take the packer's next slot (it counts the capture, as ``append`` would)
    and return ``(slot index, [T, K, H] view of the packer's buffer)``."""
    index = len(packer)
    view = packer.slot(residual)
    num_tokens, hidden_size = view.shape
    row_stride = view.stride(0)
    num_slots = row_stride // hidden_size
    if row_stride % hidden_size or not index < num_slots or view.stride(1) != 1:
        raise ValueError(f"eagle_capture: packer slot has strides {view.stride()}, expected "
                         f"({num_slots * hidden_size}, 1) for a [T, {num_slots}*{hidden_size}] buffer")
    whole = view.as_strided((num_tokens, num_slots, hidden_size), (row_stride, hidden_size, 1),
                            view.storage_offset() - index * hidden_size)
    return index, whole


def install_packer_capture(model: torch.nn.Module, *,
                           when: Callable[[object], bool] = lambda forward_batch: True) -> int:
    """Fused capture for SGLang >= 0.5.18's packer path.

    Wraps ``layer.layer_communicator.prepare_attn_and_capture_last_layer_outputs``
    of every layer of ``model`` (a ``DeepseekV2Model``): when the layer is handed a
    packer and ``when(forward_batch)`` holds, the input add+RMSNorm writes the
    capture itself; otherwise SGLang's own method runs. Returns the number of
    layers wrapped.
    """
    wrapped = 0
    for layer in model.layers:
        comm = getattr(layer, "layer_communicator", None)
        if comm is None:
            continue
        original = comm.prepare_attn_and_capture_last_layer_outputs
        if getattr(original, "_eagle_capture", False):
            continue

        def fused(hidden_states, residual, forward_batch, captured_last_layer_outputs=None,
                  *args, _original=original, _comm=comm, **kwargs):
            acc = captured_last_layer_outputs
            if (acc is None or residual is None or not hasattr(acc, "slot") or args or kwargs
                    or not when(forward_batch)):
                return _original(hidden_states, residual, forward_batch, acc, *args, **kwargs)
            norm = _comm.input_layernorm
            slot, whole = _slot_index_and_buffer(acc, residual)
            ops.add_rmsnorm_capture(hidden_states, residual, norm.weight, norm.variance_epsilon,
                                    whole, slot)
            return hidden_states, residual

        fused._eagle_capture = True
        comm.prepare_attn_and_capture_last_layer_outputs = fused
        wrapped += 1
    return wrapped
