"""vLLM plugin: the fused EAGLE-3 capture for vLLM's DeepseekV2 / DeepSeek-V3
(and Kimi-K2 / K2.5 / Kimi-VL), Llama / Mistral, Qwen2 / Qwen3, Qwen3-MoE, GPT-OSS
and MiniMax-M2 models, through vLLM's own extension point -- no edit of vLLM.

    pip install eagle-capture
    EAGLE_CAPTURE=1 vllm serve <Kimi-K2.5> --tensor-parallel-size 8 \\
        --speculative-config '{"method": "eagle3", "model": "<draft>", ...}'

``register`` is the entry point ``eagle_capture`` of group
``vllm.general_plugins`` (setup.py). vLLM's ``load_general_plugins()`` calls it
once in every process -- the API server, the engine core, every worker (before
the worker builds its model) -- and honours ``VLLM_PLUGINS`` (a comma list of
plugin names; unset: all). Installing the package changes nothing by itself:
``EAGLE_CAPTURE=1`` turns it on.

On, it re-registers those architectures (``ARCHITECTURES``; the families in
:mod:`eagle_capture.integrations.vllm.families`) as the capturing subclasses in
:mod:`eagle_capture.integrations.vllm.model` (by ``"module:Class"`` name, so the
module is imported only where a model is built). Kimi-K2.5 / Kimi-VL build their
language model through that registry as ``DeepseekV2ForCausalLM``. The capture
itself is installed when vLLM's model runner sets the layers to capture
(``set_aux_hidden_state_layers`` in ``load_model``): after the weights and the
draft are loaded, before the first forward -- hence before vLLM's torch.compile
traces the model (it compiles lazily, at the profile run) and before any CUDA
graph is captured. A model without EAGLE-3 is never asked and runs as vLLM's own.
vLLM's other EAGLE-3 targets (``CHECKED_ARCHITECTURES``: Qwen3-Next, Phi-3, Gemma 4,
Llama 4, the Qwen VL models; from vLLM 0.34 DeepSeek-V3.2 / V4 / V4.1 and Kimi-K3) are
re-registered as check-only classes (:mod:`eagle_capture.integrations.vllm.checked`): the
same start-up id check, vLLM's own capture.

``EAGLE_CAPTURE_ON_PROBLEM=refuse`` (default): ids vLLM's own capture would get
wrong stop the server at start-up with the reason; ``install``: logged as an
error and served with vLLM's own capture. ``EAGLE_CAPTURE_VERIFY=N``: the first N
eager forwards also run vLLM's own add and norm on copies and compare (captures
bit-exact), one log line each; a mismatch switches back to vLLM's own capture.
``EAGLE_CAPTURE_MAX_TOKENS``: the buffer's rows (default: vLLM's
``max_num_batched_tokens``).
"""

from __future__ import annotations

import logging

from eagle_capture.integrations.core.errors import PluginError
from eagle_capture.integrations.core.log import VLLM_LOGGER, logger
from eagle_capture.integrations.settings import SWITCH, switch_on
from eagle_capture.integrations.vllm.families import FAMILIES


def log() -> logging.Logger:
    """The plugin's logger, under vLLM's (:mod:`eagle_capture.integrations.core.log`)."""
    return logger(VLLM_LOGGER)


MODEL_MODULE = "eagle_capture.integrations.vllm.model"
# vLLM architecture -> the capturing class in MODEL_MODULE (same weights): DeepseekV2's two
# by their own names, each other family's (families.py) under vLLM's class name.
ARCHITECTURES = {
    "DeepseekV2ForCausalLM": "EagleCaptureDeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM": "EagleCaptureDeepseekV3ForCausalLM",
    **{
        arch: arch
        for family in FAMILIES
        if family.name != "DeepseekV2"
        for arch in family.architectures
    },
}

# vLLM's other EAGLE-3 targets (classes with SupportsEagle3 in vllm 0.32 not in a family;
# then 0.34's DeepSeek and Kimi targets, which live in its vllm.models.<name> packages):
# the start-up id check only (eagle_capture.integrations.vllm.checked), vLLM's own capture.
# An architecture the running vLLM does not register is left alone.
# tests/test_vllm_real.py checks each against vLLM's registry.
CHECKED_MODULE = "eagle_capture.integrations.vllm.checked"
CHECKED_ARCHITECTURES = (
    "Qwen3NextForCausalLM",
    "Phi3ForCausalLM",
    "Gemma4ForCausalLM",
    "Llama4ForCausalLM",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
    "Llama4ForConditionalGeneration",
    "DeepseekV32ForCausalLM",
    "DeepseekV4ForCausalLM",
    "DeepseekV41ForCausalLM",
    "KimiK3ForConditionalGeneration",
    "KimiK31ForConditionalGeneration",
)


def vllm_module(module: str) -> str:
    """The module of an entry of vLLM's registry table: a file of
    ``vllm/model_executor/models``, or (vLLM 0.34+) a full name such as
    ``vllm.models.deepseek_v4`` (vLLM's ``_resolve_module_name``)."""
    return module if module.startswith("vllm.") else f"vllm.model_executor.models.{module}"


__all__ = ["ARCHITECTURES", "CHECKED_ARCHITECTURES", "PluginError", "register"]


def register() -> None:
    """Entry point (group ``vllm.general_plugins``). vLLM's plugin loader only
    logs a plugin's exceptions, so every failure here is one clear error line."""
    try:
        if not switch_on():
            log().info(
                "eagle_capture: vLLM plugin loaded, off (%s=1 turns on the fused EAGLE-3 capture)",
                SWITCH,
            )
            return
        from vllm import ModelRegistry

        def vllms_own(arch):
            # Only where the registry still holds vLLM's own class (not another plugin's):
            # in vllm/model_executor/models, or from 0.34 in vllm.models.<name>.
            entry = ModelRegistry.models.get(arch)
            return getattr(entry, "module_name", "").startswith("vllm.")

        fused = [arch for arch in ARCHITECTURES if vllms_own(arch)]
        for arch in fused:
            ModelRegistry.register_model(arch, f"{MODEL_MODULE}:{ARCHITECTURES[arch]}")
        checked = [arch for arch in CHECKED_ARCHITECTURES if vllms_own(arch)]
        for arch in checked:
            ModelRegistry.register_model(arch, f"{CHECKED_MODULE}:{arch}")
        log().info(
            "eagle_capture: on (%s=1): vLLM's %s use the fused EAGLE-3 capture; the "
            "layer ids of %d other EAGLE-3 architectures are checked at start-up",
            SWITCH,
            ", ".join(fused),
            len(checked),
        )
    except Exception as e:  # noqa: BLE001 - vLLM would log a bare traceback
        log().error(
            "eagle_capture: the vLLM plugin could not register, vLLM's own capture stays: %s: %s",
            type(e).__name__,
            e,
        )
