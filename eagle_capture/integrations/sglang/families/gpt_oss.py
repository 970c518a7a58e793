"""GPT-OSS: from SGLang 0.5.18 its loop captures boundaries, boundary i + 1 after
block i, and the last one, id = the number of layers, is the final norm's input
(0.5.18 - 0.5.20 add ``hidden + residual`` there; 0.5.22+ capture in the final
norm's call). That capture comes from ``model.norm``; the others from the input
norms as every family's."""

from eagle_capture.integrations.sglang.families.base import Family


class GptOss(Family):
    name = "GptOss"
    architectures = ("GptOssForCausalLM",)
    final_boundary_since = (0, 5, 18)


FAMILY = GptOss()
