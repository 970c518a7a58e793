"""vLLM's EAGLE-3 causal LMs with the fused EAGLE-3 capture: DeepseekV2 /
DeepSeek-V3 (and Kimi's language model) and the families of
:mod:`eagle_capture.integrations.vllm.families` (Llama / Mistral, Qwen2 / Qwen3,
Qwen3-MoE, GPT-OSS, MiniMax-M2).

The plugin (:mod:`eagle_capture.integrations.vllm.plugin`) registers these
classes under vLLM's own architecture names; Kimi-K2.5 and Kimi-VL get them too,
since vLLM builds their language model through the registry as
``DeepseekV2ForCausalLM``. Names, ``state_dict`` keys and weight loading are
vLLM's (the classes add no parameter; the other families' classes even keep
vLLM's class name).

vLLM captures id ``k`` as the input of decoder layer ``k`` -- ``hidden_states +
residual``, an extra add -- and id ``num_layers`` after the last layer, before
the final norm; the runner concatenates the list it gets back (read in each
family's ``<Model>.forward``, vllm 0.32.0; docs/engine_facts.md section 6).
That sum is exactly the new residual that layer ``k``'s input norm (vLLM's
fused add + RMSNorm, in place) computes next. :meth:`set_aux_hidden_state_layers`
-- which vLLM's model runner calls in ``load_model``, after the weights and the
draft are loaded and before anything is traced or captured -- therefore

1. swaps the input norm of each captured layer (the final norm for id
   ``num_layers``) for a subclass of its own class whose call runs the
   project's add + RMSNorm that also stores the new residual into the layer's
   slot of a persistent ``[max_tokens, K, H]`` buffer: one kernel, no extra add
   (id 0 of the families whose loop captures the embedding: layer 0's input
   norm stores its input, which has no residual yet);
2. leaves vLLM's ``aux_hidden_state_layers`` empty, so vLLM's own add and list
   never run, and returns ``(hidden_states, [aux[:T, k] for each slot])`` --
   what vLLM would have returned, as ``[T, H]`` views of the buffer;
3. puts the install into ``additional_config["eagle_capture"]``, which vLLM's
   torch.compile cache key hashes: a graph compiled without the capture is
   never loaded for a model with it, nor the reverse.

Under vLLM's torch.compile the norms trace as the project's op (one node in
the FX graph, no graph break) inside a piecewise CUDA graph.

Refused at start-up, with the reason (the server does not start): duplicate
ids, id 0 in DeepseekV2 (the embedding: vLLM's loop fails there with
``residual`` None), ids outside ``[0 or 1, num_layers]``, ids in another
pipeline stage where vLLM drops them, MiniMax-M2 at PP > 1 (its loop numbers
ids per stage), a draft whose input width is not ``K x H``. Left to vLLM's own
capture, logged: PP > 1 for the families whose loop carries
the captures over stages, sequence-parallel MoE (rows token-scattered over TP),
a norm other than vLLM's plain weighted ``RMSNorm``, a device the kernels do
not run on.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from vllm.distributed import get_pp_group
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.models.deepseek_v2 import (DeepseekV2ForCausalLM,
                                                    DeepseekV3ForCausalLM)
from vllm.sequence import IntermediateTensors

from eagle_capture import ops
from eagle_capture.buffer import AuxCaptureBuffer
from eagle_capture.integrations import settings
from eagle_capture.integrations.vllm.checked import (WrongCaptureLayers, check_draft_ids,
                                                     check_layer_ids, vllm_class)
from eagle_capture.integrations.vllm.families import (CARRIED, STAGE_RELATIVE, Family,
                                                      family_of_arch)
from eagle_capture.integrations.vllm.plugin import log as _log

__all__ = ["CaptureState", "EagleCaptureDeepseekV2ForCausalLM",
           "EagleCaptureDeepseekV3ForCausalLM", "UnsupportedServer", "WrongCaptureLayers"]

# The key of the install in vLLM's additional_config, which its compile-cache key hashes.
ADDITIONAL_CONFIG_KEY = "eagle_capture"


class UnsupportedServer(ValueError):
    """A deployment the fused capture does not handle: vLLM's own capture stays."""


class CaptureState:
    """What the capturing norms and the model share: the buffer, the slot of each
    captured layer, the rows each stored in the current eager forward, and the
    self-check."""

    def __init__(self, buffer: AuxCaptureBuffer, norm_fp32_sum: bool, provider: str,
                 compiled: bool) -> None:
        self.buffer = buffer          # its layer_ids: the captured layers, ascending
        self.active = buffer          # this forward's buffer (an overflow one in eager)
        self.norm_fp32_sum = norm_fp32_sum
        self.provider = provider      # vLLM's fused_add_rms_norm implementation we match
        self.compiled = compiled      # the layer loop runs under vLLM's torch.compile
        self.keep_allreduce_fusion = False   # capture after vLLM's norm (keeps_allreduce_fusion)
        self.stored_rows: dict[int, int] = {}
        self.fused_calls = 0
        # Path f (eager forwards): a captured layer's input norm writes the new
        # residual into its slot only and hands the slot on as the residual; the
        # layer's post-attention norm then writes the next residual into the dead
        # incoming one (``spare``) instead of over the capture.
        self.residual_in_slot = not compiled
        self.pending_slot: Optional[tuple[int, torch.Tensor, torch.Tensor]] = None
        self.slot_residual_calls = 0
        self.overflow_forwards = 0
        self.disabled = False         # switched back to vLLM's own capture (self-check)
        self.verify_left = 0
        self.verify_total = 0
        self.verified_forwards = 0
        self.verify_mismatches: list[str] = []
        self.verify_norm_dev = 0.0

    def views(self, num_tokens: int) -> list[torch.Tensor]:
        aux = self.active.aux
        return [aux[:num_tokens, k] for k in range(self.active.num_captures)]

    def begin(self, num_tokens: int) -> None:
        """Pick the buffer of a forward of ``num_tokens`` tokens (eager Python)."""
        self.stored_rows = {}
        if num_tokens <= self.buffer.max_tokens:
            self.active = self.buffer
            return
        if self.compiled or _capturing_graph(self.buffer.aux):
            raise ValueError(
                f"eagle_capture: a forward of {num_tokens} tokens but the aux buffer has "
                f"{self.buffer.max_tokens} rows, and a compiled or CUDA-graph forward cannot "
                f"take a buffer of its own: raise {settings.MAX_TOKENS} to vLLM's "
                f"max_num_batched_tokens or more")
        if self.active.max_tokens != num_tokens:
            self.active = AuxCaptureBuffer(num_tokens, self.buffer.hidden_size,
                                           self.buffer.layer_ids, dtype=self.buffer.aux.dtype,
                                           device=self.buffer.aux.device)
            self.overflow_forwards += 1
            _log().warning("eagle_capture: a forward of %d tokens exceeds the aux buffer's %d "
                           "rows: its captures go to a buffer of its own (%d such forwards)",
                           num_tokens, self.buffer.max_tokens, self.overflow_forwards)

    def check_slot_consumed(self) -> None:
        """A residual left in a slot (path f) must have been taken by its layer's
        post-attention norm before anything else updates it."""
        pending, self.pending_slot = self.pending_slot, None
        if pending is not None:
            raise RuntimeError(
                f"eagle_capture: layer {pending[0]}'s residual was left in its aux slot but its "
                f"post-attention norm never took it: this model's layer does something else "
                f"between its two norms than the loops the plugin was built on")

    def check_complete(self, num_tokens: int) -> None:
        """Every captured layer stored ``num_tokens`` rows in this eager forward."""
        self.check_slot_consumed()
        stored = self.stored_rows
        wrong = {layer: stored.get(layer) for layer in self.buffer.layer_ids
                 if stored.get(layer) != num_tokens}
        if wrong:
            raise RuntimeError(
                f"eagle_capture: in a forward of {num_tokens} tokens the captured layers "
                f"stored {wrong} rows (layer: rows; None = not captured): the draft would get "
                f"stale rows. Was the model's layer loop or a norm replaced after the install?")


def _capturing_graph(like: torch.Tensor) -> bool:
    return like.is_cuda and torch.cuda.is_current_stream_capturing()


def _capture_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
    """The capturing norm's call: vLLM's ``RMSNorm(x, residual)`` -> ``(normed,
    new residual)`` with the new residual also stored into this layer's slot:
    eager, written into the slot only and handed on as the residual (path f);
    compiled, in place as vLLM's in-place implementations do plus the slot (path
    e), or after vLLM's own norm where its all-reduce fusion pass runs."""
    state: CaptureState = self._eagle_capture_state
    if state.disabled:
        return self._eagle_capture_base.forward(self, x, residual)
    eager = not torch.compiler.is_compiling()
    if residual is None:
        # Layer 0 of the first stage: the stream is the embedding output itself
        # (vLLM's mixin loops capture it as is for id 0), stored before the norm.
        ops.add_capture(x, None, state.active.aux, self._eagle_capture_slot)
        if eager and not _capturing_graph(x):
            state.stored_rows[self._eagle_capture_layer] = x.shape[0]
            if state.verify_left > 0:
                captured = state.active.aux[:x.shape[0], self._eagle_capture_slot]
                if not torch.equal(captured, x):
                    state.verify_mismatches.append(
                        f"layer {self._eagle_capture_layer}: capture differs from the "
                        f"embedding output vLLM captures")
        return self._eagle_capture_base.forward(self, x, residual)
    reference = None
    if eager and state.verify_left > 0:
        # vLLM's own capture (its expression) and its own norm, on copies.
        reference = (x + residual, self._eagle_capture_base.forward(self, x.clone(),
                                                                    residual.clone()))
    aux, slot = state.active.aux, self._eagle_capture_slot
    if state.keep_allreduce_fusion and not eager:
        # vLLM's AllReduceFusionPass matches all_reduce -> its fused_add_rms_norm IR op
        # and swaps in FlashInfer's all-reduce + add + RMSNorm: the norm stays vLLM's
        # (one pattern like every other layer's) and the capture copies its residual.
        normed, new_residual = self._eagle_capture_base.forward(self, x, residual)
        ops.add_capture(new_residual, None, aux, slot)
        return normed, new_residual
    if eager and state.residual_in_slot and self._eagle_slot_reader is not None:
        # Path f: one write of the new residual, into the slot.
        state.check_slot_consumed()
        ops.add_rmsnorm_into_slot(x, residual, self.weight, self.variance_epsilon, aux, slot,
                                  norm_fp32_sum=state.norm_fp32_sum)
        new_residual = aux[:x.shape[0], slot]
        if self._eagle_slot_reader == POST_NORM:   # else the final norm's, discarded
            state.pending_slot = (self._eagle_capture_layer, new_residual, residual)
        state.slot_residual_calls += 1
    else:
        ops.add_rmsnorm_capture(x, residual, self.weight, self.variance_epsilon, aux, slot,
                                norm_fp32_sum=state.norm_fp32_sum)
        new_residual = residual
    if eager and not _capturing_graph(x):
        state.stored_rows[self._eagle_capture_layer] = x.shape[0]
        state.fused_calls += 1
        if reference is not None:
            _compare(state, self._eagle_capture_layer, aux[:x.shape[0], slot], x, new_residual,
                     reference)
    return x, new_residual


def _slot_taking_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
    """A captured layer's post-attention norm under path f: when ``residual`` is
    the slot its input norm left, the next residual goes into the spare (vLLM's
    in-place norm would overwrite the capture), bit-identical to vLLM's."""
    state: CaptureState = self._eagle_capture_state
    pending = state.pending_slot
    if pending is None or pending[0] != self._eagle_capture_layer or residual is not pending[1]:
        return self._eagle_capture_base.forward(self, x, residual)
    state.pending_slot = None
    spare = pending[2]
    if spare.shape == x.shape and spare.dtype == x.dtype and spare.is_contiguous():
        ops.add_rmsnorm_out(x, residual, self.weight, self.variance_epsilon, spare,
                            norm_fp32_sum=state.norm_fp32_sum)
        return x, spare
    spare = residual.clone()   # vLLM's own norm on a copy (never reached in vLLM 0.32's loops)
    return self._eagle_capture_base.forward(self, x, spare)


def _compare(state: CaptureState, layer: int, captured, normed, residual, reference) -> None:
    expected, (ref_normed, ref_residual) = reference
    if not torch.equal(captured, expected):
        bad = (captured != expected).any(dim=-1).nonzero().flatten()[:4].tolist()
        state.verify_mismatches.append(f"layer {layer}: capture differs from vLLM's "
                                       f"hidden_states + residual (rows {bad}...)")
    if not torch.equal(residual, ref_residual):
        state.verify_mismatches.append(f"layer {layer}: new residual differs from vLLM's norm")
    dev = ((normed.float() - ref_normed.float()).abs()
           / ref_normed.float().abs().clamp_min(1e-6)).max().item() if normed.numel() else 0.0
    state.verify_norm_dev = max(state.verify_norm_dev, dev)
    rtol = settings.VERIFY_NORM_RTOL.get(normed.dtype, 2.0 ** -6)
    close = torch.allclose(normed.float(), ref_normed.float(), rtol=rtol, atol=rtol)
    if not close:
        state.verify_mismatches.append(f"layer {layer}: normed output off vLLM's norm by "
                                       f"{dev:.3g} (relative, tolerance {rtol:.3g})")


_NORM_CLASSES: dict[tuple, type] = {}
# Who reads a captured norm's new residual next, for path f: the layer's post-attention
# norm (swapped to take it), or nobody (the final norm: every family discards it).
POST_NORM, NOBODY = "post-attention norm", "nobody"


def _plain_rmsnorm(norm) -> bool:
    return isinstance(norm, RMSNorm) and norm.has_weight and norm.variance_size_override is None



def _capturing_class(cls: type, forward=_capture_norm) -> type:
    """A subclass of vLLM's norm class whose call also captures (or, for
    ``_slot_taking_norm``, takes the slot's residual): the instance's class is
    swapped; names, parameters and ``isinstance`` unchanged."""
    key = (cls, forward)
    if key not in _NORM_CLASSES:
        prefix = "EagleCapture" if forward is _capture_norm else "EagleSlotTaking"
        _NORM_CLASSES[key] = type(f"{prefix}{cls.__name__}", (cls,),
                                  {"forward": forward, "_eagle_capture_base": cls,
                                   "__module__": __name__})
    return _NORM_CLASSES[key]


def keeps_allreduce_fusion(vllm_config, compiled: bool) -> bool:
    """Whether vLLM's compile runs its all-reduce + RMSNorm fusion pass here
    (``pass_config.fuse_allreduce_rms``: on by default at TP > 1 on Hopper /
    Blackwell with FlashInfer). The pass matches ``all_reduce`` followed by vLLM's
    ``fused_add_rms_norm`` IR op; a captured norm replaced by the project's op
    would leave that layer's all-reduce unfused, so the capture goes after vLLM's
    norm instead (a copy of its residual)."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    pass_config = getattr(getattr(vllm_config, "compilation_config", None), "pass_config", None)
    return (compiled and bool(getattr(pass_config, "fuse_allreduce_rms", False))
            and get_tensor_model_parallel_world_size() > 1)


def fused_add_rms_norm_provider(like: torch.Tensor) -> str:
    """Which implementation of vLLM's ``fused_add_rms_norm`` runs for tensors
    like ``like`` (its IR op's current priority)."""
    from vllm import ir
    op = ir.ops.fused_add_rms_norm
    x = torch.zeros(2, like.shape[-1], dtype=like.dtype, device=like.device)
    return op.dispatch(x, x.clone(), torch.ones_like(x[0]), 1e-6, None).provider


class _FusedCapture:
    """The EAGLE-3 interface of vLLM's DeepseekV2ForCausalLM, with the fused capture."""

    _eagle_capture: Optional[CaptureState] = None

    def set_aux_hidden_state_layers(self, layers) -> None:
        model = self.model
        uninstall(self)   # vLLM may set the layers again: start from vLLM's own model
        try:
            state = install(self, layers)
        except UnsupportedServer as e:
            _log().warning("eagle_capture: not applicable here, vLLM's own capture stays: %s", e)
            state = None
        except WrongCaptureLayers:
            if settings.on_problem() == "refuse":
                raise
            _log().exception("eagle_capture: PROBLEM (%s=install): vLLM's own capture serves "
                             "these ids as it would without the plugin", settings.ON_PROBLEM)
            state = None
        if state is None:
            super().set_aux_hidden_state_layers(layers)
            return
        self._eagle_capture = state
        model.aux_hidden_state_layers = ()   # vLLM's own add + list never run

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None,
                **kwargs):
        state = self._eagle_capture
        if state is None or state.disabled:
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds,
                                   **kwargs)
        num_tokens = positions.shape[-1]
        eager = not state.compiled and not torch.compiler.is_compiling()
        if eager:
            state.begin(num_tokens)
        elif num_tokens > state.buffer.max_tokens:
            state.begin(num_tokens)   # raises: a compiled forward cannot overflow
        hidden_states = super().forward(input_ids, positions, intermediate_tensors,
                                        inputs_embeds, **kwargs)
        if isinstance(hidden_states, IntermediateTensors):
            return hidden_states
        if isinstance(hidden_states, tuple):
            raise RuntimeError("eagle_capture: vLLM's own capture ran next to the fused one "
                               "(aux_hidden_state_layers was set again after the install)")
        views = state.views(num_tokens)
        if eager and not _capturing_graph(state.buffer.aux):
            state.check_complete(num_tokens)
            if state.verify_left > 0:
                _end_verify(self, state, num_tokens)
                if state.disabled:   # the self-check switched back: vLLM's own result
                    return super().forward(input_ids, positions, intermediate_tensors,
                                           inputs_embeds, **kwargs)
        return hidden_states, views


def _end_verify(causal_lm, state: CaptureState, num_tokens: int) -> None:
    state.verify_left -= 1
    state.verified_forwards += 1
    n = state.verified_forwards
    if state.verify_mismatches:
        _log().error("eagle_capture: self-check %d/%d FAILED (%d tokens): %s. Switching back "
                     "to vLLM's own capture", n, state.verify_total, num_tokens,
                     "; ".join(state.verify_mismatches))
        state.disabled = True
        state.verify_left = 0
        # vLLM's own set (the mixin families also cache their pipeline layout there).
        super(_FusedCapture, causal_lm).set_aux_hidden_state_layers(
            tuple(state.buffer.layer_ids))
        return
    _log().info("eagle_capture: self-check %d/%d OK (%d tokens): %d captures bit-exact with "
                "vLLM's hidden_states + residual, normed output within %.3g of vLLM's %s norm",
                n, state.verify_total, num_tokens, state.buffer.num_captures,
                state.verify_norm_dev, state.provider)


# ------------------------------------------------------------------- install

def _draft_hf_config(vllm_config):
    """The EAGLE-3 draft's config as vLLM parsed it, or None (no draft here)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return getattr(getattr(spec, "draft_model_config", None), "hf_config", None)


def _nested_ids(draft) -> Optional[list]:
    eagle = getattr(draft, "eagle_config", None)
    return eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None


def draft_width_problem(vllm_config, num_captures: int, hidden_size: int) -> Optional[str]:
    """The draft's fc input (vLLM's Eagle3 drafts: ``num_aux_hidden_states``, else
    the eagle_config ids' count, else 3) vs what the target captures."""
    draft = _draft_hf_config(vllm_config)
    if draft is None:
        return None
    ids = _nested_ids(draft)
    expected = getattr(draft, "num_aux_hidden_states", None) or (len(ids) if ids else 3)
    target_hidden = getattr(draft, "target_hidden_size", None) or hidden_size
    if expected != num_captures or target_hidden != hidden_size:
        return (f"the draft expects {expected} x {target_hidden} input features but the target "
                f"captures {num_captures} layers of width {hidden_size}")
    return None


def buffer_rows(vllm_config, compiled: bool, env=os.environ) -> tuple[int, str]:
    """The buffer's rows: vLLM's ``max_num_batched_tokens`` (no forward is
    larger: the scheduler's token budget, the profile run and every CUDA-graph
    size are within it), or ``EAGLE_CAPTURE_MAX_TOKENS``."""
    limit = int(vllm_config.scheduler_config.max_num_batched_tokens)
    raw = env.get(settings.MAX_TOKENS, "").strip()
    if not raw:
        return limit, f"vLLM's max_num_batched_tokens {limit}"
    try:
        rows = int(raw)
        if rows < 1:
            raise ValueError
    except ValueError:
        raise settings.PluginError(f"{settings.MAX_TOKENS}={raw!r}: expected a number of "
                                   f"tokens >= 1") from None
    if rows < limit and compiled:
        raise settings.PluginError(
            f"{settings.MAX_TOKENS}={rows} is below vLLM's max_num_batched_tokens {limit}, and "
            f"a compiled / CUDA-graph forward of more tokens cannot take a buffer of its own: "
            f"unset it or raise it to {limit}")
    return rows, f"{settings.MAX_TOKENS}={rows} (vLLM's max_num_batched_tokens {limit})"


def install(causal_lm, layers) -> CaptureState:
    """Install the fused capture of ``layers`` (vLLM's ids) on ``causal_lm``."""
    from vllm.config import get_current_vllm_config

    model = causal_lm.model
    config = causal_lm.config
    family: Family = causal_lm._eagle_family
    num_layers = int(config.num_hidden_layers)
    hidden = int(config.hidden_size)
    pp = get_pp_group()
    if pp.world_size > 1 and family.pipeline == CARRIED:
        raise UnsupportedServer(
            f"{pp.world_size} pipeline stages: vLLM's {family.name} loop carries the earlier "
            f"stages' captures to the last one (IntermediateTensors); the fused capture serves "
            f"one stage")
    if pp.world_size > 1 and family.pipeline == STAGE_RELATIVE:
        raise WrongCaptureLayers(
            f"eagle_capture: {pp.world_size} pipeline stages: vLLM's {family.name} loop numbers "
            f"the aux ids from its stage's first layer (layers {model.start_layer}.."
            f"{model.end_layer - 1} here), so on the last stage id k captures the input of "
            f"layer start + k, not of layer k: the draft would get other layers than "
            f"{list(layers)}. Serve without pipeline parallelism")
    if not pp.is_last_rank:
        raise UnsupportedServer("not the last pipeline stage (vLLM drops aux hidden states "
                                "captured here; its runner asks only the last stage)")
    captured = check_layer_ids(layers, num_layers, model.start_layer, model.end_layer,
                               family.embedding_id)
    vllm_config = getattr(model, "vllm_config", None) or get_current_vllm_config()
    problem = draft_width_problem(vllm_config, len(captured), hidden)
    if problem:
        raise WrongCaptureLayers(f"eagle_capture: {problem}")
    check_draft_ids(causal_lm, layers, vllm_config)   # what the draft was trained on
    decoder_layers = [model.layers[i] for i in range(model.start_layer, model.end_layer)]
    if any(getattr(layer, "use_sequence_parallel_moe", False) for layer in decoder_layers):
        raise UnsupportedServer("sequence-parallel MoE: the captured rows are token-scattered "
                                "over the TP group and vLLM all-gathers each capture")
    norms = {i: (model.norm if i == model.end_layer else model.layers[i].input_layernorm)
             for i in captured}
    for i, norm in norms.items():
        if not _plain_rmsnorm(norm):
            raise UnsupportedServer(f"layer {i}'s norm is {type(norm).__name__} (the fused "
                                    f"capture replaces vLLM's plain weighted RMSNorm)")
    weight = norms[captured[0]].weight
    if weight.device.type not in ops.KERNEL_DEVICE_TYPES | {"cpu"} or torch.version.hip:
        raise UnsupportedServer(f"the model is on {weight.device} "
                                f"({'ROCm' if torch.version.hip else weight.device.type}): the "
                                f"kernels run on CUDA and the CPU path on CPU")
    compiled = not getattr(model, "do_not_compile", True)
    rows, rows_reason = buffer_rows(vllm_config, compiled)
    # Match vLLM's own norm: its native implementation (CPU, and CUDA under
    # Inductor) normalises the fp32 sum; its CUDA kernel (enforce_eager) the
    # rounded one. The capture itself is the rounded sum either way.
    provider = fused_add_rms_norm_provider(weight)
    norm_fp32_sum = provider != "vllm_c"
    buffer = AuxCaptureBuffer(rows, hidden, captured, dtype=weight.dtype, device=weight.device)
    state = CaptureState(buffer, norm_fp32_sum, provider, compiled)
    state.keep_allreduce_fusion = keeps_allreduce_fusion(vllm_config, compiled)
    state.verify_left = state.verify_total = settings.verify_forwards()
    if state.verify_total and compiled:
        _log().warning("eagle_capture: %s=%d needs eager forwards (enforce_eager): the layer "
                       "loop is compiled here, no self-check runs", settings.VERIFY,
                       state.verify_total)
        state.verify_left = state.verify_total = 0
    for slot, i in enumerate(captured):
        norm = norms[i]
        norm.__class__ = _capturing_class(type(norm))
        norm._eagle_capture_state = state
        norm._eagle_capture_slot = slot
        norm._eagle_capture_layer = i
        post = getattr(model.layers[i], "post_attention_layernorm", None) \
            if i < model.end_layer else None
        if i == model.end_layer:
            norm._eagle_slot_reader = NOBODY
        elif i > 0 and _plain_rmsnorm(post):
            norm._eagle_slot_reader = POST_NORM
            post.__class__ = _capturing_class(type(post), _slot_taking_norm)
            post._eagle_capture_state = state
            post._eagle_capture_layer = i
        else:
            norm._eagle_slot_reader = None   # path f off: a norm we do not know reads it
    additional = getattr(vllm_config, "additional_config", None)
    if isinstance(additional, dict):
        additional[ADDITIONAL_CONFIG_KEY] = {
            "layers": captured, "rows": rows, "norm_fp32_sum": norm_fp32_sum,
            "keep_allreduce_fusion": state.keep_allreduce_fusion}
    elif compiled:
        _log().warning("eagle_capture: vLLM's additional_config is not a dict here: set "
                       "VLLM_DISABLE_COMPILE_CACHE=1 so that no graph compiled without the "
                       "capture is loaded")
    nbytes = buffer.aux.numel() * buffer.aux.element_size()
    default = tuple(captured) == (2, num_layers // 2, num_layers - 3)
    _log().info(
        "eagle_capture: fused EAGLE-3 capture ON (vLLM, %s, %s family, TP rank %s): ids %s = "
        "inputs of layers %s%s -> slots 0..%d, buffer [%d, %d, %d] %s = %.1f MiB on %s (%s); "
        "norm as vLLM's %s fused_add_rms_norm (%s sum); %s%s",
        type(causal_lm).__name__, family.name, _tp_rank(), list(layers), captured,
        " (vLLM's defaults)" if default else "", len(captured) - 1, rows, len(captured), hidden,
        str(weight.dtype).replace("torch.", ""), nbytes / 2**20, weight.device, rows_reason,
        provider, "fp32" if norm_fp32_sum else "rounded",
        ("traced into vLLM's torch.compile graph" + (
            " after vLLM's own norm, which its all-reduce + RMSNorm fusion pass keeps fusing"
            if state.keep_allreduce_fusion else "")) if compiled
        else "eager, the new residual written into the slot only (path f)",
        f"; self-check of the first {state.verify_total} forwards" if state.verify_total else "")
    return state


def uninstall(causal_lm) -> None:
    """vLLM's own norms and capture back (a later install starts from them)."""
    state = causal_lm.__dict__.pop("_eagle_capture", None)
    model = causal_lm.model
    for norm in [getattr(layer, name, None) for layer in model.layers
                 for name in ("input_layernorm", "post_attention_layernorm")] + \
            [getattr(model, "norm", None)]:
        base = getattr(type(norm), "_eagle_capture_base", None)
        if base is not None:
            norm.__class__ = base
            for name in ("_eagle_capture_state", "_eagle_capture_slot", "_eagle_capture_layer",
                         "_eagle_slot_reader"):
                norm.__dict__.pop(name, None)
    if state is not None:
        model.aux_hidden_state_layers = ()


def _tp_rank():
    try:
        from vllm.distributed import get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - outside a server
        return "?"


_DEEPSEEK = family_of_arch("DeepseekV2ForCausalLM")


class EagleCaptureDeepseekV2ForCausalLM(_FusedCapture, DeepseekV2ForCausalLM):
    """vLLM's DeepseekV2ForCausalLM (and Kimi-K2.5's / Kimi-VL's language model)
    with the fused EAGLE-3 capture."""
    _eagle_family = _DEEPSEEK


class EagleCaptureDeepseekV3ForCausalLM(_FusedCapture, DeepseekV3ForCausalLM):
    """vLLM's DeepseekV3ForCausalLM (DeepSeek-V3, Kimi-K2) with the fused EAGLE-3 capture."""
    _eagle_family = _DEEPSEEK


_MADE: dict[type, type] = {}


def __getattr__(name: str) -> type:
    """The capturing class of the other families' architectures (the plugin
    registers ``"<this module>:<architecture>"``), made on first use from vLLM's
    own class: the same name (vLLM's logs and name checks see its own), the
    capture in front."""
    if name.startswith("__"):
        raise AttributeError(name)
    try:
        family = family_of_arch(name)
    except KeyError:
        raise AttributeError(name) from None
    if family is _DEEPSEEK:   # the two classes above
        raise AttributeError(name)
    base = vllm_class(name)
    if base not in _MADE:
        _MADE[base] = type(base.__name__, (_FusedCapture, base),
                           {"__module__": __name__, "__qualname__": base.__name__,
                            "__doc__": base.__doc__, "_eagle_family": family})
    made = _MADE[base]
    globals()[base.__name__] = made   # found by its own name too (pickling by reference)
    return made
