"""Which tensor SGLang's own EAGLE-3 capture holds, measured against transformers'
``hidden_states`` for the same weights (one process per SGLang line, the line's own
transformers pin).

A draft is trained on transformers' ``hidden_states[k]`` (the residual stream
entering layer k). Right ids do not help a draft if a line's loop captures another
tensor at that place -- the layer's normed input, or the previous layer's branch
before the residual add (its MLP's output; Gemma: the norm after the MLP). Each scenario builds one family's SGLang model
(``family_models.build`` / ``harness.build_model``: the wheel's real model class,
decoder layers, communicator / layer boundaries, RMSNorms, capture loop and
LogitsProcessor; attention and MLP / MoE stood in, since SGLang's kernels need a
GPU) and the transformers model of the same config, with SGLang's embedding and
RMSNorm weights copied in and the SAME stand-in modules (``0.5 * tanh(h @ W^T)``,
per row) in place of attention and MLP. Both loops then compute the same function
when they wire the residual stream the same way; what the draft receives from
SGLang (the LogitsProcessor's output, slot by slot) is compared with
``hidden_states[k]``, with the normed input and with the pre-residual output.

Result per family: ``tensor`` -- "residual stream", "normed input",
"pre-residual output" or "other" (the nearest, with every distance).
"""

from __future__ import annotations

import re

import torch

from tests.sglang_real import family_models, harness

NUM_LAYERS = 7
CAPTURE_IDS = (1, 3, 5)  # SGLang captures layers 2, 4, 6 (DeepseekV2: the same)
TOKENS = 9
TOLERANCE = 1e-4  # fp32, two implementations of the same RMSNorm

# family -> (SGLang's architecture built, transformers' class of the same config)
FAMILIES = {
    "llama": ("LlamaForCausalLM", "LlamaForCausalLM"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3ForCausalLM"),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeForCausalLM"),
    "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeForCausalLM"),
    "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2ForCausalLM"),
    "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3ForCausalLM"),
    # Kimi-K2.5's SGLang class hands the ids to its DeepseekV3 language model; its
    # transformers class is remote code: the text model's, DeepseekV3.
    "kimi_k25": ("KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM"),
    "gemma3": ("Gemma3ForCausalLM", "Gemma3ForCausalLM"),
    "gemma4": ("Gemma4ForCausalLM", "Gemma4ForCausalLM"),
    # Gemma 4's multimodal class hands the ids to its text model (language_model): a text
    # prompt against transformers' text model, the one a Gemma 4 draft is trained on.
    "gemma4_mm": ("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM"),
}
DEEPSEEK = ("deepseek_v2", "deepseek_v3", "kimi_k25")
# What the measurement says the capture holds (the doctor's data has the same words).
RESIDUAL, NORMED, PRE_RESIDUAL, OTHER = (
    "residual stream",
    "normed input",
    "pre-residual output",
    "other",
)


def _sglang_model(family: str):
    if family not in DEEPSEEK:
        return family_models.build(family, capture_ids=CAPTURE_IDS, num_layers=NUM_LAYERS)
    return harness.build_model(
        num_layers=NUM_LAYERS, capture_ids=CAPTURE_IDS, arch=FAMILIES[family][0]
    )


class _Same(torch.nn.Module):
    """transformers' attention / MLP slot running SGLang's stand-in (the same weights,
    the same per-row function); attention returns (output, weights) as transformers'
    decoder layers unpack it."""

    def __init__(self, standin, attention: bool):
        super().__init__()
        self.w = standin.w
        self.attention = attention
        self.last = None

    def forward(self, *args, **kwargs):
        h = kwargs.get("hidden_states", args[0] if args else None)
        out = (0.5 * torch.tanh(h.float() @ self.w.t())).to(h.dtype)
        self.last = out
        return (out, None) if self.attention else out


def _text(model):
    """(SGLang's text model, its config, its weights named as a causal LM's:
    ``model.``...): the causal LM's ``model``, or Gemma 4's multimodal
    ``language_model`` (a text model itself)."""
    lm = harness.text_lm(model)
    text, prefix = (lm.model, "") if "model" in lm._modules else (lm, "model.")
    named = {**dict(lm.named_parameters()), **dict(lm.named_buffers())}
    return text, lm.config, {prefix + name: t for name, t in named.items()}


def _hf_model(family: str, text, cfg, state: dict):
    """transformers' model of SGLang's text model ``text`` (config ``cfg``), SGLang's
    embedding and norm weights (``state``, named as a causal LM's), SGLang's stand-ins
    in the attention and MLP slots."""
    import transformers

    _, arch = FAMILIES[family]
    if family in DEEPSEEK:
        # A fresh copy of the config the harness built SGLang's model from (SGLang
        # rewrites its own copy's rope type to one transformers does not know).
        cfg = harness.make_config(num_layers=NUM_LAYERS, hidden_size=cfg.hidden_size)
        if family == "deepseek_v2":  # the same text config, read by DeepseekV2's class
            cfg = transformers.DeepseekV2Config(
                **{
                    k: v
                    for k, v in cfg.to_dict().items()
                    if k not in ("model_type", "transformers_version", "architectures")
                }
            )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    hf = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():
        for name, p in [*hf.named_parameters(), *hf.named_buffers()]:
            # Every norm of the decoder layer itself (Gemma: four; the attention's own
            # norms are stood in with it), the embedding, the final norm; Gemma 4: the
            # per-layer embedding's weights and each layer's scalar.
            if (
                name in ("model.embed_tokens.weight", "model.norm.weight")
                or re.fullmatch(r"model\.layers\.\d+\.\w*layernorm\.weight", name)
                or family_models.GEMMA4_EXTRA.fullmatch(name)
            ):
                p.copy_(state[name].to(p.dtype))
    ffn = family_models.FFN_ATTR.get(family, "mlp")
    for mine, theirs in zip(hf.model.layers, text.layers):
        mine.self_attn = _Same(theirs.self_attn, attention=True)
        mine.mlp = _Same(getattr(theirs, ffn), attention=False)
    return hf


def _branch(layer):
    """The module whose output a transformers decoder layer adds to the residual stream
    last: the MLP, or the norm after it (Gemma's post_feedforward_layernorm)."""
    return getattr(layer, "post_feedforward_layernorm", None) or layer.mlp


def _controls(hf, states, ple, k, got) -> dict:
    """Gemma 4's layer ends ``(stream + ple) * layer_scalar``: the residual stream
    without the previous layer's scaling and without its per-layer-embedding add, to
    show the measurement tells a capture that missed either apart (max abs diff of
    the slot to each; not candidates of the result). Empty for other families."""
    import torch

    prev = hf.model.layers[k - 1] if k >= 1 else None
    scalar = getattr(prev, "layer_scalar", None)
    if scalar is None:
        return {}
    with torch.no_grad():
        unscaled = states[k][0].float() / scalar.float()
        controls = {"stream before layer_scalar": float((got - unscaled).abs().max())}
        if k - 1 in ple:
            before = unscaled - ple[k - 1][0].float()
            controls["stream before the per-layer input"] = float((got - before).abs().max())
    return {"controls": controls}


def measure(family: str) -> dict:
    """What each slot SGLang hands the draft holds, against transformers."""
    with torch.no_grad():
        return _measure(family)


def _measure(family: str) -> dict:
    model = _sglang_model(family)
    text, cfg, state = _text(model)
    layers = sorted(text.layers_to_capture)
    batch = harness.make_batch(model, TOKENS, "extend", seed=5)
    call = harness.run(model, batch)
    aux = harness.draft_input(call)
    assert aux is not None, "SGLang handed the draft no aux"
    hidden = cfg.hidden_size
    hf = _hf_model(family, text, cfg, state)
    outputs = {}

    def keep(i):
        def hook(module, args, output):
            outputs[i] = output

        return hook

    hooks = [
        _branch(layer).register_forward_hook(keep(i)) for i, layer in enumerate(hf.model.layers)
    ]
    # Gemma 4: the per-layer embedding's contribution each layer adds after its FFN branch
    # (post_per_layer_input_norm's output), for the controls below.
    ple = {}
    for i, layer in enumerate(hf.model.layers):
        if getattr(layer, "post_per_layer_input_norm", None) is not None:
            hooks.append(
                layer.post_per_layer_input_norm.register_forward_hook(
                    lambda m, a, o, i=i: ple.__setitem__(i, o)
                )
            )
    with torch.no_grad():
        out = hf.model(input_ids=batch[0][None], output_hidden_states=True)
    for h in hooks:
        h.remove()
    states = out.hidden_states
    emb = hf.model.embed_tokens(batch[0][None])
    assert torch.equal(states[0], emb), "hidden_states[0] is not the embedding"
    slots = []
    for slot, k in enumerate(layers):
        got = aux[:, slot * hidden : (slot + 1) * hidden].float()
        candidates = {
            RESIDUAL: states[k][0].float(),
            NORMED: hf.model.layers[k].input_layernorm(states[k])[0].float()
            if k < NUM_LAYERS
            else None,
            PRE_RESIDUAL: outputs[k - 1][0].float() if k >= 1 else None,
        }
        dist = {
            name: float((got - ref).abs().max())
            for name, ref in candidates.items()
            if ref is not None
        }
        nearest = min(dist, key=dist.get)
        slots.append(
            {
                "layer": k,
                "tensor": nearest if dist[nearest] <= TOLERANCE else OTHER,
                "max_abs_diff": dist,
                **_controls(hf, states, ple, k, got),
            }
        )
    tensors = {s["tensor"] for s in slots}
    result = {
        "architecture": FAMILIES[family][0],
        "transformers": FAMILIES[family][1],
        "layers": layers,
        "tensor": tensors.pop() if len(tensors) == 1 else OTHER,
        "slots": slots,
    }
    # Distinct candidates, or the measurement tells nothing apart.
    for s in slots:
        others = [v for name, v in s["max_abs_diff"].items() if name != s["tensor"]]
        others += list(s.get("controls", {}).values())
        assert all(v > 100 * TOLERANCE for v in others), (
            f"layer {s['layer']}: the candidates are too close to tell apart: {s['max_abs_diff']}"
        )
    return result


def scenario(family: str) -> dict:
    """The measurement. A class without set_eagle3_layers_to_capture on this line
    (Kimi-K2.5 and Gemma 3 on 0.5.9) captures nothing, and a model the line does not
    have (Gemma 4 before 0.5.13) is not built: said, not measured (the engine facts
    carry it). Whether the tensor is the residual stream the draft was trained on is
    the test's to judge (tests/test_sglang_real.py): Gemma 3 from 0.5.18 is measured
    to hold something else."""
    import importlib
    import importlib.util

    module = {
        "DeepseekV2ForCausalLM": "deepseek_v2",
        "DeepseekV3ForCausalLM": "deepseek_v2",
        "KimiK25ForConditionalGeneration": "kimi_k25",
    }.get(FAMILIES[family][0])
    module = module or family_models.MODELS[family][0]
    harness._ensure_stubs()  # before SGLang's model code is imported
    if importlib.util.find_spec(f"sglang.srt.models.{module}") is None:
        return {
            "architecture": FAMILIES[family][0],
            "tensor": None,
            "why": f"no sglang.srt.models.{module} on this line",
        }
    cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), FAMILIES[family][0])
    if not hasattr(cls, "set_eagle3_layers_to_capture"):
        return {
            "architecture": FAMILIES[family][0],
            "tensor": None,
            "why": "no set_eagle3_layers_to_capture on this line",
        }
    return measure(family)
