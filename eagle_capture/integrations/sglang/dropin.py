"""Drop-in fused EAGLE-3 capture for SGLang's model loops, SGLang 0.5.9 - 0.5.23:
:func:`install_eagle3_capture`. The families (:mod:`.families`: DeepseekV2 /
DeepSeek-V3 / Kimi-K2 / K2.5, Llama / Qwen2 / Qwen3, Qwen2/3-MoE, GPT-OSS,
GLM-4 MoE, MiniMax-M2) each name where their captured norms are; this install
is the same for all.

Every line's captured value is the new residual that a captured layer's input
norm writes (``norm(x, residual, post_residual_addition)``; GPT-OSS's final
boundary: the final norm's); what each line does around it is in
docs/engine_facts.md section 1. The install

1. swaps each captured norm's *class* for a capturing subclass of its real
   class (names, ``state_dict`` keys, weight loading and ``isinstance``
   unchanged): the plain call runs our fused add + RMSNorm + slot store (the
   residual-in-slot path: the new residual written into the slot only and
   handed on as a view; the layer's post-attention norm then writes out of
   place; the slot-copy path: a second write into the slot, under
   torch.compile, where SGLang's all-reduce fusion may run, and where no
   post-attention norm follows); every other branch runs SGLang's own code,
   then stores the reduced residual;
2. switches the model's own capture off (the family's adapter: layers_to_capture
   emptied, per-layer marks cleared);
3. swaps the ``LogitsProcessor``'s class so it is handed the packed
   ``[T, K*H]`` view of our buffer (a list of one for <= 0.5.13).

Only classes are swapped, never an instance ``forward``: SGLang's piecewise
CUDA graphs replace instance forwards, so installing before or after them works.

Beside it: :mod:`.norms` (the capturing norm and logits classes, both paths),
:mod:`.state` (the capture state, the completeness check, the self-check),
:mod:`.server_modes` (what SGLang's server runs, read through each line's helpers).
Rows token-scattered over an attention-TP group are all-gathered into the slot
over SGLang's own group. Refused at install, with the reason: a capture not
enabled, another stage's layers, layer 0 (unless ``allow_embedding=True``),
two-batch overlap, context parallelism, layernorm sequence parallelism, and
what a family's adapter refuses.
Checked on every eager forward: each captured layer stored exactly T rows, and
SGLang's own capture was not re-enabled.
"""

import sys
from typing import Optional

import torch

from eagle_capture.buffer import AuxCaptureBuffer
from eagle_capture.integrations.sglang import allreduce
from eagle_capture.integrations.sglang.families import family_of
from eagle_capture.integrations.sglang.norms import (
    CapturingLogitsMixin,
    CapturingNormMixin,
    SlotResidualPostNormMixin,
    with_mixin,
)
from eagle_capture.integrations.sglang.server_modes import (
    UnsupportedServer,
    allreduce_fusion_max_tokens,
    dp_attention_enabled,
    refuse_unsupported_modes,
    rows_may_scatter,
    scattered_captures,
)
from eagle_capture.integrations.sglang.state import CaptureState, WrongCaptureLayers, logger
from eagle_capture.layer_ids import validate
from eagle_capture.layer_ids.lines import parse_version

__all__ = [
    "CaptureState",
    "UnsupportedServer",
    "WrongCaptureLayers",
    "install_eagle3_capture",
    "reapply_after_reconfigure",
    "text_model_of",
]


def text_model_of(model: torch.nn.Module) -> tuple[torch.nn.Module, str]:
    """The causal LM inside SGLang's ``model`` and the attribute path to it (its
    family's reading: the model itself, or a wrapper's ``language_model`` as
    Kimi-K2.5's)."""
    return family_of(model).text_model_of(model)


def sglang_version() -> Optional[tuple]:
    """The installed SGLang's version as a tuple (None where it cannot be read:
    then no line-dependent capture, such as a final boundary, is accepted)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return parse_version(version("sglang"))
    except (PackageNotFoundError, ValueError):
        return None


def install_eagle3_capture(
    causal_lm: torch.nn.Module,
    max_tokens: int,
    *,
    allow_embedding: bool = False,
    residual_in_slot: bool = True,
    fused_allreduce: bool = False,
    allreduce_table=None,
    dtype: Optional[torch.dtype] = None,
    device: Optional[torch.device] = None,
) -> AuxCaptureBuffer:
    """Replace SGLang's EAGLE-3 capture in ``causal_lm`` (one of
    :data:`.families.FUSED_ARCHITECTURES`) by the fused one; returns the buffer (``max_tokens`` rows: the most tokens one forward
    runs, chunked prefill and CUDA-graph batches included; an eager forward with
    more gets a buffer of its own, with a warning).

    Call it where SGLang's model runner has just called
    ``model.set_eagle3_layers_to_capture(...)`` (end of ``load_model``; from 0.5.18
    in ``configure_aux_hidden_state_capture``) and before CUDA graphs are
    captured: a graph captured earlier replays SGLang's own capture. The SGLang
    plugin (:mod:`eagle_capture.integrations.sglang.plugin`) does exactly that.

    ``residual_in_slot`` (the residual-in-slot path): where the layer's plain norms run, the input
    norm writes the new residual into the slot only and the post-attention norm
    writes the next one out of place, so the capture costs no extra write (eager
    and CUDA graphs; under torch.compile, and for forwards SGLang's all-reduce
    fusion may take at TP > 1, the residual is stored in place and copied once
    into the slot: the slot-copy path). False: the slot-copy path everywhere.

    ``fused_allreduce`` (opt-in): where SGLang would fuse a captured layer's
    deferred all-reduce into its input norm (TP > 1), run the project's one
    kernel or SGLang's all-reduce + the fused op instead of SGLang's fusion +
    a capture copy, per T by ``allreduce_table`` (a :class:`PathTable`, path or
    dict; default ``$EAGLE_CAPTURE_ALLREDUCE_TABLE``): :mod:`.allreduce`.
    Collective on CUDA (a symmetric buffer on every TP rank). Where it does not
    apply (TP 1, DP attention, scattered rows) it logs why and stays off.

    Raises :class:`WrongCaptureLayers` for layer ids SGLang's own capture would
    also get wrong, :class:`UnsupportedServer` for server modes the fused capture
    does not handle (the family's refusals among them), ``TypeError`` for a model
    it does not know (:class:`.families.UnknownFamily`).
    """
    family = family_of(causal_lm)
    wrapper = causal_lm
    causal_lm, _ = family.text_model_of(wrapper)
    model = causal_lm.model
    if isinstance(getattr(causal_lm, "_eagle_capture", None), CaptureState):
        raise ValueError("eagle_capture: the fused capture is already installed on this model")
    sglang_layers = family.engine_layers(causal_lm)
    if not getattr(causal_lm, "capture_aux_hidden_states", False) or not sglang_layers:
        raise ValueError(
            "eagle_capture: EAGLE-3 capture is not enabled on this model; install "
            "after set_eagle3_layers_to_capture(...) (on the last PP rank)"
        )
    logits = getattr(causal_lm, "logits_processor", None)
    if not isinstance(logits, torch.nn.Module):
        raise TypeError("eagle_capture: the model has no logits_processor module")
    check_capture_layers(
        sglang_layers,
        getattr(model, "start_layer", 0),
        getattr(model, "end_layer", len(model.layers)),
        allow_embedding,
        final_boundary=family.captures_final_boundary(sglang_version()),
        num_layers=len(model.layers),
    )
    layer_ids = sorted(sglang_layers)
    refuse_unsupported_modes()
    family.refuse(causal_lm, layer_ids)

    norms, surfaces = [], []
    for i in layer_ids:
        norm, surface = family.captured_norm(model, i)
        norms.append(norm)
        if surface not in surfaces:
            surfaces.append(surface)
    post_norms = [family.post_attention_norm(model, i) for i in layer_ids]
    weight = norms[0].weight
    buffer = AuxCaptureBuffer(
        max_tokens,
        weight.shape[0],
        layer_ids,
        dtype=dtype or weight.dtype,
        device=device or weight.device,
    )
    # Hand the LogitsProcessor a packed tensor where its line takes one (0.5.18+:
    # it reads a tensor or a list), else the list it concatenates.
    packed_tensor = any(
        hasattr(sys.modules.get(c.__module__), "pack_aux_hidden_states")
        for c in type(logits).__mro__
    )
    state = CaptureState(
        buffer,
        layer_ids,
        " and ".join(surfaces),
        packed_tensor,
        sglang_layers=sglang_layers,
        causal_lm=causal_lm,
        family=family,
    )

    for i, norm in zip(layer_ids, norms):
        norm.__class__ = with_mixin(CapturingNormMixin, type(norm))
        norm._eagle_capture = state
        norm._eagle_layer_id = i
    # Not under DP attention: there SGLang's DP gather reads the residual around
    # the post-attention norm and may call that norm without it (0.5.9, or an
    # attention-TP group of several ranks, where the reduced rows are scattered
    # back into the residual), so the slot could not hand it on. Nor where rows
    # are token-scattered: SGLang then slices the residual around that norm.
    # Nor where a captured norm has no post-attention norm after it (the final
    # boundary): nothing would take the residual from the slot.
    state.scattered_layers = scattered_captures(model, layer_ids)
    if (
        residual_in_slot
        and not dp_attention_enabled()
        and not rows_may_scatter()
        and all(n is not None for n in post_norms)
    ):
        for i, norm in zip(layer_ids, post_norms):
            norm.__class__ = with_mixin(SlotResidualPostNormMixin, type(norm))
            norm._eagle_capture = state
            norm._eagle_layer_id = i
        state.residual_in_slot_enabled = True
        state.residual_in_slot_above = allreduce_fusion_max_tokens()
    state.fallback_reduces = allreduce.fallback_reduces()
    if fused_allreduce:
        why = (
            "the captured layers' rows are token-scattered over the attention-TP group"
            if rows_may_scatter()
            else ""
        )
        if not why:
            fusion_rows = allreduce_fusion_max_tokens() or max_tokens
            state.allreduce, why = allreduce.build(
                min(max_tokens, fusion_rows),
                buffer.hidden_size,
                buffer.aux.dtype,
                buffer.aux.device,
                allreduce_table,
            )
        if state.allreduce is None:
            logger().warning(
                "eagle_capture: the captured layers' fused all-reduce is off (%s): "
                "SGLang's all-reduce fusion and a capture copy stay there",
                why,
            )
    logits.__class__ = with_mixin(CapturingLogitsMixin, type(logits))
    logits._eagle_capture = state
    family.engine_capture_off(causal_lm)
    causal_lm._eagle_capture = state
    if wrapper is not causal_lm:
        object.__setattr__(wrapper, "_eagle_capture", state)
    return buffer


def reapply_after_reconfigure(model: torch.nn.Module) -> bool:
    """SGLang called ``set_eagle3_layers_to_capture`` again on an installed
    model (a second ``configure_aux_hidden_state_capture``): turn its own capture
    off again if it asks for the same layers (True), else raise. False when
    nothing is installed."""
    family = family_of(model)
    causal_lm, _ = family.text_model_of(model)
    state = getattr(causal_lm, "_eagle_capture", None)
    if not isinstance(state, CaptureState):
        return False
    if state.disabled:
        return True  # SGLang's own capture on by design (self-check mismatch)
    again = family.engine_layers(causal_lm)
    if again and sorted(again) != state.layer_ids:
        raise WrongCaptureLayers(
            f"eagle_capture: SGLang set layers_to_capture to {again} after the fused capture "
            f"was installed for {state.layer_ids}; restart the server (the buffer and CUDA "
            f"graphs are built for the first set)"
        )
    family.engine_capture_off(causal_lm)
    return True


def check_capture_layers(
    layers: list[int],
    start: int,
    end: int,
    allow_embedding: bool,
    *,
    final_boundary: bool = False,
    num_layers: Optional[int] = None,
) -> None:
    """Refuse layers_to_capture that would not give the draft K distinct, existing
    layers of this stage (the shared validation,
    :func:`eagle_capture.layer_ids.validate.check_capture_layers`): this rank runs
    layers ``[start, end)`` of ``num_layers``; ``final_boundary``: the family's loop
    captures ``num_layers`` (the final norm's input) on this line. Without
    ``num_layers``, ``end`` is taken as the layer count where ``final_boundary``."""
    if num_layers is None and final_boundary:
        num_layers = end
    validate.check_capture_layers(
        layers,
        num_layers=num_layers,
        final_boundary=final_boundary,
        embedding=allow_embedding,
        stage=(start, end),
        error=WrongCaptureLayers,
    )
