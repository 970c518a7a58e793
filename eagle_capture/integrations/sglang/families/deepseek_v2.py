"""DeepseekV2's loop (DeepSeek-V3 / V3.1, Kimi-K2, Kimi-K2.5 through its
``.language_model``): every line calls the input norm through the layer
communicator (<= 0.5.20) or the attention stage boundary (0.5.22+), never by
itself; layers_to_capture + ``capture_aux_hidden_states`` drive its capture."""

from eagle_capture.integrations.sglang.families.base import Family


class DeepseekV2(Family):
    name = "DeepseekV2"
    architectures = (
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "KimiK25ForConditionalGeneration",
    )
    wrappers = ("language_model",)  # Kimi-K2.5 (its .model aliases it)
    direct_norm_calls = False


FAMILY = DeepseekV2()
