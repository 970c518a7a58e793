"""vLLM's EAGLE-3 families that get the fused capture: one entry per family, what
its layer loop does that the install must know. Read in vllm 0.32.0's
``model_executor/models/{deepseek_v2,llama,mistral,qwen2,qwen3,qwen3_moe,gpt_oss,
minimax_m2}.py`` and ``interfaces.py`` (docs/engine_facts.md sections 6 and 6.2).

What every family shares -- and why one install serves them all: id ``k`` in
``1..num_layers-1`` is ``hidden_states + residual`` entering decoder layer ``k``,
whose ``input_layernorm(hidden_states, residual)`` (vLLM's fused add + RMSNorm)
computes exactly that sum next; id ``num_layers`` is the sum entering the final
``model.norm(hidden_states, residual)``; the list comes back in ascending layer
order; ``model.aux_hidden_state_layers`` empty means no capture. They differ in
id 0 and in pipeline parallelism, below.

A new family is one entry here (after reading its loop) and its rows in
``tests/vllm_real/family_models.py``. This module imports no vLLM model code (the
plugin reads it in every process).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CARRIED", "FAMILIES", "Family", "LAST_STAGE", "STAGE_RELATIVE", "family_of_arch"]

# What vLLM's loop does with the captures when the model is split over pipeline stages:
LAST_STAGE = "last stage"  # the earlier stages' captures are dropped: the fused capture
#                                  serves the last stage, ids in another stage are refused
CARRIED = "carried"  # supports_aux_hidden_states_over_pp: earlier stages pack theirs
#                                  into the IntermediateTensors; left to vLLM's own capture
STAGE_RELATIVE = "stage relative"  # the loop numbers ids from its stage's first layer: at PP > 1
#                                    it captures other layers than the ids say (refused)


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]  # vLLM registry names whose class gets the capture
    embedding_id: bool  # id 0 = the embedding output (else vLLM's loop fails there)
    pipeline: str  # LAST_STAGE, CARRIED or STAGE_RELATIVE


FAMILIES = (
    # DeepseekV2Model.forward: `hidden_states + residual` inline, before layer idx; id 0 has
    # residual None (TypeError). Kimi-K2.5 / Kimi-VL build their language model as
    # DeepseekV2ForCausalLM through the registry.
    Family(
        "DeepseekV2",
        ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"),
        embedding_id=False,
        pipeline=LAST_STAGE,
    ),
    # LlamaModel / Qwen2Model (Qwen3Model is Qwen2's; MistralModel is Llama's):
    # EagleModelMixin._maybe_add_hidden_state -- id start_layer on the first stage (the
    # embedding: residual None), id idx + 1 after layer idx; supports_aux_hidden_states_over_pp.
    Family(
        "Llama",
        ("LlamaForCausalLM", "LLaMAForCausalLM", "MistralForCausalLM"),
        embedding_id=True,
        pipeline=CARRIED,
    ),
    Family(
        "Qwen2 / Qwen3",
        ("Qwen2ForCausalLM", "Qwen3ForCausalLM"),
        embedding_id=True,
        pipeline=CARRIED,
    ),
    # Qwen3MoeModel / GptOssModel: the same mixin calls with absolute ids (id start_layer on
    # every stage), no carrying over PP: like DeepseekV2, only the last stage's reach the draft.
    Family("Qwen3-MoE", ("Qwen3MoeForCausalLM",), embedding_id=True, pipeline=LAST_STAGE),
    Family("GPT-OSS", ("GptOssForCausalLM",), embedding_id=True, pipeline=LAST_STAGE),
    # MiniMaxM2Model: `_maybe_add_hidden_state([], 0, ...)` and `enumerate(islice(layers,
    # start_layer, end_layer))` from 0: ids relative to the stage.
    Family("MiniMax-M2", ("MiniMaxM2ForCausalLM",), embedding_id=True, pipeline=STAGE_RELATIVE),
)


def family_of_arch(arch: str) -> Family:
    for family in FAMILIES:
        if arch in family.architectures:
            return family
    raise KeyError(arch)
