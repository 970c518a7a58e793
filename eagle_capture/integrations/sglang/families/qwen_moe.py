"""Qwen2-MoE / Qwen3-MoE: the causal LM delegates ``set_eagle3_layers_to_capture``
to its model, which also marks each captured layer with ``_is_layer_to_capture``;
the loop reads those marks (not ``layers_to_capture``), so they are what turns
its capture off and back on."""

from eagle_capture.integrations.sglang.families.base import Family


class QwenMoe(Family):
    name = "Qwen-MoE"
    architectures = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

    def engine_capture_off(self, causal_lm) -> None:
        super().engine_capture_off(causal_lm)
        for layer in causal_lm.model.layers:
            if getattr(layer, "_is_layer_to_capture", False):
                layer._is_layer_to_capture = False

    def engine_capture_on(self, causal_lm, layers) -> None:
        super().engine_capture_on(causal_lm, layers)
        for i in layers:
            causal_lm.model.layers[i]._is_layer_to_capture = True


FAMILY = QwenMoe()
