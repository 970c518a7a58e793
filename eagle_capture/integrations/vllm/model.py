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

vLLM captures id ``k`` as the input of decoder layer ``k`` and id ``num_layers``
after the last layer, before the final norm; the runner concatenates the list it
gets back (read in each family's ``<Model>.forward``, vllm 0.32.0;
docs/engine_facts.md section 6). :meth:`set_aux_hidden_state_layers` -- which
vLLM's model runner calls in ``load_model``, after the weights and the draft are
loaded and before anything is traced or captured -- therefore

1. installs the fused capture (:mod:`.install`: the capturing norms of
   :mod:`.norms`, the buffer and state of :mod:`.state`), or leaves vLLM's own
   capture where the install says it does not apply;
2. leaves vLLM's ``aux_hidden_state_layers`` empty, so vLLM's own add and list
   never run, and :meth:`forward` returns ``(hidden_states, [aux[:T, k] for each
   slot])`` -- what vLLM would have returned, as ``[T, H]`` views of the buffer --
   after checking that every captured layer stored this forward's rows, and
   finishing the self-check of an eager forward (``EAGLE_CAPTURE_VERIFY``).

Under vLLM's torch.compile the norms trace as the project's op (one node in
the FX graph, no graph break) inside a piecewise CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from vllm.sequence import IntermediateTensors

from eagle_capture.integrations import settings
from eagle_capture.integrations.core.errors import UnsupportedServer, WrongCaptureLayers
from eagle_capture.integrations.vllm.checked import vllm_class
from eagle_capture.integrations.vllm.families import family_of_arch
from eagle_capture.integrations.vllm.install import install, uninstall
from eagle_capture.integrations.vllm.state import CaptureState, capturing_graph, log

__all__ = [
    "CaptureState",
    "EagleCaptureDeepseekV2ForCausalLM",
    "EagleCaptureDeepseekV3ForCausalLM",
    "UnsupportedServer",
    "WrongCaptureLayers",
]


class _FusedCapture:
    """The EAGLE-3 interface of vLLM's DeepseekV2ForCausalLM, with the fused capture."""

    _eagle_capture: Optional[CaptureState] = None

    def set_aux_hidden_state_layers(self, layers) -> None:
        model = self.model
        uninstall(self)  # vLLM may set the layers again: start from vLLM's own model
        try:
            state = install(self, layers)
        except UnsupportedServer as e:
            log().warning("eagle_capture: not applicable here, vLLM's own capture stays: %s", e)
            state = None
        except WrongCaptureLayers:
            if settings.on_problem() == "refuse":
                raise
            log().exception(
                "eagle_capture: PROBLEM (%s=install): vLLM's own capture serves "
                "these ids as it would without the plugin",
                settings.ON_PROBLEM,
            )
            state = None
        if state is None:
            super().set_aux_hidden_state_layers(layers)
            return
        self._eagle_capture = state
        model.aux_hidden_state_layers = ()  # vLLM's own add + list never run

    def forward(
        self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **kwargs
    ):
        state = self._eagle_capture
        if state is None or state.disabled:
            return super().forward(
                input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs
            )
        num_tokens = positions.shape[-1]
        eager = not state.compiled and not torch.compiler.is_compiling()
        if eager:
            state.begin(num_tokens)
        elif num_tokens > state.buffer.max_tokens:
            state.begin(num_tokens)  # raises: a compiled forward cannot overflow
        hidden_states = super().forward(
            input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs
        )
        if isinstance(hidden_states, IntermediateTensors):
            return hidden_states
        if isinstance(hidden_states, tuple):
            raise RuntimeError(
                "eagle_capture: vLLM's own capture ran next to the fused one "
                "(aux_hidden_state_layers was set again after the install)"
            )
        views = state.views(num_tokens)
        if eager and not capturing_graph(state.buffer.aux):
            state.check_complete(num_tokens)
            if state.verify_left > 0:
                _end_verify(self, state, num_tokens)
                if state.disabled:  # the self-check switched back: vLLM's own result
                    return super().forward(
                        input_ids, positions, intermediate_tensors, inputs_embeds, **kwargs
                    )
        return hidden_states, views


def _end_verify(causal_lm, state: CaptureState, num_tokens: int) -> None:
    mismatches = state.take_verified_forward()
    n = state.verified_forwards
    if mismatches:
        log().error(
            "eagle_capture: self-check %d/%d FAILED (%d tokens): %s. Switching back "
            "to vLLM's own capture",
            n,
            state.verify_total,
            num_tokens,
            "; ".join(mismatches),
        )
        state.switch_back()
        # vLLM's own set (the mixin families also cache their pipeline layout there).
        super(_FusedCapture, causal_lm).set_aux_hidden_state_layers(tuple(state.buffer.layer_ids))
        return
    log().info(
        "eagle_capture: self-check %d/%d OK (%d tokens): %d captures bit-exact with "
        "vLLM's hidden_states + residual, normed output within %.3g of vLLM's %s norm",
        n,
        state.verify_total,
        num_tokens,
        state.buffer.num_captures,
        state.verify_norm_dev,
        state.provider,
    )


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
    if family is _DEEPSEEK:  # the two classes above
        raise AttributeError(name)
    base = vllm_class(name)
    if base not in _MADE:
        _MADE[base] = type(
            base.__name__,
            (_FusedCapture, base),
            {
                "__module__": __name__,
                "__qualname__": base.__name__,
                "__doc__": base.__doc__,
                "_eagle_family": family,
            },
        )
    made = _MADE[base]
    globals()[base.__name__] = made  # found by its own name too (pickling by reference)
    return made
