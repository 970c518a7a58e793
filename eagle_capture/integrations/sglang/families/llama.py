"""The Llama-style dense loop: Llama (3.x, and the classes SGLang derives from it),
Qwen2, Qwen3. <= 0.5.20 the Llama and Qwen2 layers call their norms themselves
(Qwen3 through a layer communicator) and the model adds ``hidden + residual``
before a captured layer; 0.5.23 calls them through the stage boundaries with a
capture callback. Either way the capture is the new residual the captured
layer's input norm writes."""

from eagle_capture.integrations.sglang.families.base import Family


class Llama(Family):
    name = "Llama"
    architectures = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


FAMILY = Llama()
