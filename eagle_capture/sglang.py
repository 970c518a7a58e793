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
    check still holds) and runs the fused add+RMSNorm+capture on it, while
    SGLang's ``prepare_attn`` (all-reduce, scatter, attention inputs) still runs.
    Only for plain tensor parallelism, where the capture-point gather is the
    identity; with DP attention or all-to-all MoE the rows must be gathered
    first (the tensor-parallel issue), so pass ``when`` to keep those batches
    on SGLang's own path.
"""

from typing import Callable, Optional

import torch

from . import ops
from .buffer import AuxCaptureBuffer


class _NormProxy(torch.nn.Module):
    """Wraps an SGLang ``RMSNorm``: attributes and methods it does not define
    (``weight``, ``variance_epsilon``, ``forward_with_allreduce_fusion``, ...) are
    the wrapped norm's, so every path SGLang may take still reaches the norm."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("norm"), name)


class CapturingRMSNorm(_NormProxy):
    """Stand-in for a captured layer's ``input_layernorm`` (classic loop): same
    weight, same call signature and in-place semantics
    (``forward(x, residual) -> (x, residual)``), plus the capture store.

    Any other path (e.g. ``forward_with_allreduce_fusion``) goes to the wrapped
    norm *without* a capture; the model-level count check in
    :func:`install_classic_capture` turns that into an error instead of a stale
    buffer."""

    def __init__(self, norm: torch.nn.Module, buffer: AuxCaptureBuffer, layer_id: int,
                 counter: list) -> None:
        super().__init__(norm)
        self.buffer = buffer
        self.layer_id = layer_id
        self.slot = buffer.slot_of(layer_id)
        self._counter = counter

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, *args, **kwargs):
        if args or kwargs:
            return self.norm(x, residual, *args, **kwargs)   # not ours: no capture, counted missing
        self._counter[0] += 1
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
    batches included). The captured layers' input norm is replaced both on the
    layer and on its ``layer_communicator`` (which holds its own reference and is
    what the layer calls); every eager forward then checks that each captured
    layer really ran the capturing norm, so a path that bypasses it (e.g. the
    fused all-reduce + RMSNorm) is an error, not a stale buffer.
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
    weight = model.layers[layer_ids[0]].input_layernorm.weight
    buffer = AuxCaptureBuffer(max_tokens, weight.shape[0], layer_ids,
                              dtype=dtype or weight.dtype, device=device or weight.device)
    counter = [0]
    for i in layer_ids:
        layer = model.layers[i]
        norm = layer.input_layernorm
        comm = getattr(layer, "layer_communicator", None)
        if comm is not None and getattr(comm, "input_layernorm", norm) is not norm:
            raise ValueError(f"eagle_capture: layer {i}'s layer_communicator holds another "
                             f"input_layernorm than the layer; this SGLang version is not "
                             f"supported by install_classic_capture")
        capturing = CapturingRMSNorm(norm, buffer, i, counter)
        layer.input_layernorm = capturing
        if comm is not None:
            comm.input_layernorm = capturing
    # The loop's own `aux.append(hidden_states + residual)` is no longer needed.
    model.layers_to_capture = []
    model._eagle_capture_buffer = buffer
    inner_forward = model.forward

    def forward(*args, **kwargs):
        counter[0] = 0
        hidden_states = inner_forward(*args, **kwargs)
        if isinstance(hidden_states, tuple):  # something else still captured: refuse to mix
            raise RuntimeError("eagle_capture: the model captured through its own list too; "
                               "layers_to_capture was changed after install")
        if counter[0] != len(layer_ids) and not torch.compiler.is_compiling():
            raise RuntimeError(
                f"eagle_capture: only {counter[0]} of the {len(layer_ids)} captured layers "
                f"{layer_ids} stored their capture in this forward: a captured layer ran its "
                f"input norm through another path (e.g. the fused all-reduce + RMSNorm); the "
                f"buffer would be stale. Disable that fusion at captured layers or use the "
                f"tensor-parallel entry points (eagle_capture.tp)")
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


class PackerSlotNorm(_NormProxy):
    """A layer communicator's ``input_layernorm`` that, when handed a packer for
    this call (``pending``), writes the new residual straight into the packer's
    next slot from inside the fused add+RMSNorm."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__(norm)
        self.pending = None

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None, *args, **kwargs):
        packer = self.pending
        if packer is None or residual is None or args or kwargs:
            return self.norm(x, residual, *args, **kwargs)
        self.pending = None
        slot, whole = _slot_index_and_buffer(packer, residual)
        ops.add_rmsnorm_capture(x, residual, self.norm.weight, self.norm.variance_epsilon,
                                whole, slot)
        return x, residual


def install_packer_capture(model: torch.nn.Module, *,
                           when: Callable[[object], bool] = lambda forward_batch: True) -> int:
    """Fused capture for SGLang >= 0.5.18's packer path.

    For every layer of ``model`` (a ``DeepseekV2Model``) with a
    ``layer_communicator``: its ``input_layernorm`` becomes a :class:`PackerSlotNorm`
    and ``prepare_attn_and_capture_last_layer_outputs`` is wrapped. When a layer is
    handed a packer and ``when(forward_batch)`` holds, SGLang's own method still
    runs (all-reduce, scatter and attention-input handling unchanged) but without
    the capture; the norm, if it runs through its plain ``forward``, stores the
    capture itself. If the method took another path (e.g. the fused all-reduce +
    RMSNorm), the reduced residual it returns is appended to the packer as SGLang
    would have done. Returns the number of layers wrapped.
    """
    wrapped = 0
    for layer in model.layers:
        comm = getattr(layer, "layer_communicator", None)
        if comm is None:
            continue
        original = comm.prepare_attn_and_capture_last_layer_outputs
        if getattr(original, "_eagle_capture", False):
            continue
        norm = comm.input_layernorm
        if not isinstance(norm, PackerSlotNorm):
            norm = PackerSlotNorm(norm)
            comm.input_layernorm = norm

        def fused(hidden_states, residual, forward_batch, captured_last_layer_outputs=None,
                  *args, _original=original, _norm=norm, **kwargs):
            acc = captured_last_layer_outputs
            if acc is None or residual is None or not hasattr(acc, "slot") or not when(forward_batch):
                return _original(hidden_states, residual, forward_batch, acc, *args, **kwargs)
            _norm.pending = acc
            try:
                out = _original(hidden_states, residual, forward_batch, None, *args, **kwargs)
            finally:
                missed = _norm.pending is not None
                _norm.pending = None
            if missed:  # the norm ran through another path: SGLang's own capture
                acc.append(out[1])
            return out

        fused._eagle_capture = True
        comm.prepare_attn_and_capture_last_layer_outputs = fused
        wrapped += 1
    return wrapped
