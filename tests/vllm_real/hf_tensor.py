"""Which tensor vLLM's own EAGLE-3 capture holds, measured against transformers'
``hidden_states`` for the same weights (the SGLang counterpart:
tests/sglang_real/hf_tensor.py, which says why).

vLLM's own class of each family (its layer loop, decoder layers, RMSNorms and
capture), loaded by vLLM's loader (DeepSeek-V3: from the harness's random checkpoint,
which transformers reads too); attention stood in as ``family_models`` does
(a KV cache is needed otherwise) and the MLP / MoE block by the same parameterless
elementwise map on both sides (so no weight has to be translated between the two
layouts); transformers' model of the same config.json gets vLLM's embedding and
RMSNorm weights and calls the same stand-ins. Each captured slot is compared with
``hidden_states[k]``, the layer's normed input and the previous layer's MLP output
before the residual add.
"""

from __future__ import annotations

import os

import torch

from tests.vllm_real import family_models as fm
from tests.vllm_real import harness as h

CAPTURE = (2, 4, 6)  # vLLM's ids are capture layers (the input of layer k)
TOKENS = 9
TOLERANCE = 1e-4
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
RESIDUAL, NORMED, PRE_RESIDUAL, OTHER = (
    "residual stream",
    "normed input",
    "pre-residual output",
    "other",
)


class _Attention(torch.nn.Module):
    """transformers' attention slot calling vLLM's stand-in of the same layer."""

    def __init__(self, vllm_attention):
        super().__init__()
        object.__setattr__(self, "inner", vllm_attention)  # not a submodule

    def forward(self, *args, **kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        out = self.inner(hidden_states=x.reshape(-1, x.shape[-1]))
        return out.reshape(x.shape), None


class _FFN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.last = None

    def forward(self, x):
        self.last = torch.tanh(x * 1.5) * 0.5
        return self.last


def measure(family: str, work: str) -> dict:
    import transformers

    from eagle_capture.integrations.vllm.checked import vllm_class

    if family == "deepseek_v3":
        # The harness's random DeepSeek-V3 checkpoint (transformers' own class, saved):
        # vLLM loads its weights; transformers reads the same folder below.
        arch = "DeepseekV3ForCausalLM"
        folder = h.write_checkpoint(os.path.join(work, "hf_tensor_deepseek_v3"))
        vc = h.engine_config(folder)
        model = h.load(vc, vllm_class(arch))
        h.stand_in_attention(model)
        stood = {i: layer.self_attn for i, layer in enumerate(model.model.layers)}

        def attention(layer_index):
            inner = stood[layer_index]
            return lambda hidden_states: inner(None, hidden_states)
    else:
        arch = fm.FAMILIES[family][0]
        folder = fm.write_config(os.path.join(work, f"hf_tensor_{family}"), family)
        vc = fm.engine_config(folder)
        model = h.load(vc, vllm_class(arch))
        fm.fill(model)
        fm.stand_in(model, family)
        attn_attr = fm.ATTENTION_ATTR.get(family, "self_attn")

        def attention(layer_index):
            return getattr(model.model.layers[layer_index], attn_attr)

    ffn = "mlp"
    for layer in model.model.layers:
        setattr(layer, ffn, _FFN())
    model.set_aux_hidden_state_layers(CAPTURE)
    ids = h.tokens(TOKENS, 5)
    out = h.forward(model, vc, ids)
    assert isinstance(out, tuple), "vLLM returned no aux hidden states"
    aux = out[1]

    config = transformers.AutoConfig.from_pretrained(folder)
    config._attn_implementation = "eager"
    hf = getattr(transformers, arch)(config).eval()
    mine = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name in ("model.embed_tokens.weight", "model.norm.weight") or name.endswith(
                (".input_layernorm.weight", ".post_attention_layernorm.weight")
            ):
                p.copy_(mine[name][: p.shape[0]].to(p.dtype))
    ffns = []
    for i, layer in enumerate(hf.model.layers):
        layer.self_attn = _Attention(attention(i))
        layer.mlp = _FFN()
        ffns.append(layer.mlp)
    with torch.no_grad():
        states = hf.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        slots = []
        for slot, k in enumerate(CAPTURE):
            got = aux[slot].float()
            candidates = {
                RESIDUAL: states[k][0].float(),
                NORMED: hf.model.layers[k].input_layernorm(states[k])[0].float(),
                PRE_RESIDUAL: ffns[k - 1].last[0].float(),
            }
            dist = {n: float((got - ref).abs().max()) for n, ref in candidates.items()}
            nearest = min(dist, key=dist.get)
            slots.append(
                {
                    "layer": k,
                    "tensor": nearest if dist[nearest] <= TOLERANCE else OTHER,
                    "max_abs_diff": dist,
                }
            )
    for s in slots:
        others = [v for n, v in s["max_abs_diff"].items() if n != s["tensor"]]
        assert all(v > 100 * TOLERANCE for v in others), (
            f"layer {s['layer']}: the candidates are too close to tell apart: {s['max_abs_diff']}"
        )
    tensors = {s["tensor"] for s in slots}
    return {
        "architecture": arch,
        "layers": list(CAPTURE),
        "tensor": tensors.pop() if len(tensors) == 1 else OTHER,
        "slots": slots,
    }


def scenario(family: str, work: str) -> dict:
    result = measure(family, work)
    assert result["tensor"] == RESIDUAL, (
        f"vLLM's capture holds the {result['tensor']}, not the residual stream: {result}"
    )
    return result
