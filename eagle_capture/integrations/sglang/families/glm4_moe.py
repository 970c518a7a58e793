"""GLM-4.5 / 4.6 / 4.7 (GLM-4 MoE): the Llama-style reading, except that with
ROCm aiter's FP8 per-token quantization its attention reads the layer input
through a fused RMSNorm + quant that bypasses the norm module: refused there."""

from eagle_capture.integrations.sglang.families.base import Family
from eagle_capture.integrations.sglang.server_modes import UnsupportedServer


class Glm4Moe(Family):
    name = "Glm4Moe"
    architectures = ("Glm4MoeForCausalLM",)

    def refuse(self, causal_lm, layer_ids) -> None:
        fused = [
            i
            for i in layer_ids
            if i < len(causal_lm.model.layers)
            and getattr(causal_lm.model.layers[i], "attn_quant_format", "")
        ]
        if fused:
            raise UnsupportedServer(
                f"eagle_capture: GLM-4 MoE layers {fused} run ROCm aiter's fused RMSNorm + FP8 "
                f"quant ({causal_lm.model.layers[fused[0]].attn_quant_format}), which does not "
                f"call the input norm the capture lives in"
            )


FAMILY = Glm4Moe()
