"""MiniMax-M2: the loop hands its capture list to the layer communicator's
``prepare_attn_and_capture_last_layer_outputs`` (<= 0.5.20) or the attention
stage boundary's gathered capture (0.5.23); the value is the captured layer's
input-norm residual as everywhere. Layer 0 calls its norm without a residual
(the embedding, refused unless allow_embedding)."""

from eagle_capture.integrations.sglang.families.base import Family


class MiniMaxM2(Family):
    name = "MiniMaxM2"
    architectures = ("MiniMaxM2ForCausalLM",)


FAMILY = MiniMaxM2()
