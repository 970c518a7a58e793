"""SGLang's own model classes of the other EAGLE-3 families, built on CPU the way
``harness.build_model`` builds DeepseekV2: the wheel's real ``<Model>ForCausalLM``
(decoder layers, communicator / stage boundaries, RMSNorms, capture loop, logits
processor), attention and MLP / MoE stood in by ``harness``'s deterministic
``StandIn`` (TP 1) or ``RowParallelStandIn`` (TP > 1), tiny configs from
transformers' own config classes.

``build(family, dtype, capture_ids, seed)`` -> the model with SGLang's
``set_eagle3_layers_to_capture(capture_ids)`` called. ``harness.make_batch``,
``harness.run`` and ``harness.draft_input`` work on it unchanged.
"""

from __future__ import annotations

import re

from tests.sglang_real import harness

# family -> (SGLang module, EntryClass, transformers config class)
FAMILIES = {
    "llama": ("llama", "LlamaForCausalLM", "LlamaConfig"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", "Qwen3Config"),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig"),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig"),
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM", "GptOssConfig"),
    "glm4_moe": ("glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig"),
    "minimax_m2": ("minimax_m2", "MiniMaxM2ForCausalLM", "MiniMaxM2Config"),
}
# Built the same way but no family of the plugin's (what hf_tensor.py measures): Gemma 3's
# text model, a scaled embedding and four norms a layer; from 0.5.18 its layers hand the
# residual add to the next layer's norm.
MEASURED_ONLY = {
    "gemma3": ("gemma3_causal", "Gemma3ForCausalLM", "Gemma3TextConfig"),
    # Gemma 4's text model: Gemma 3's four norms a layer, then the per-layer embedding
    # (PLE) added to the stream and the whole stream scaled by the layer's layer_scalar.
    "gemma4": ("gemma4_causal", "Gemma4ForCausalLM", "Gemma4TextConfig"),
    # Its multimodal class (the checkpoints' architecture): the same text model as its
    # ``language_model``, built from a Gemma4Config with that text config and a one-layer
    # vision tower (no image in the batch), run through its own forward.
    "gemma4_mm": ("gemma4_mm", "Gemma4ForConditionalGeneration", "Gemma4TextConfig"),
}
MODELS = {**FAMILIES, **MEASURED_ONLY}

# A family built as another's text model inside a multimodal class.
TEXT_OF = {"gemma4_mm": "gemma4"}

# The decoder layer's feed-forward attribute where it is not ``mlp``.
FFN_ATTR = {"minimax_m2": "block_sparse_moe"}
# GPU-only packages a model file imports at module level on some lines (minimax_m2
# <= 0.5.22: tvm_ffi): stubbed (stubs.py: a call raises), the CPU path needs none.
GPU_ONLY_IMPORTS = {"minimax_m2": ("tvm_ffi",)}


def tiny_config(family: str, num_layers: int, hidden_size: int, vocab_size: int = 128):
    """A tiny config of ``family``'s transformers class: 4 heads of 16, GQA 2 KV
    heads, 4 experts of which 2 per token for the MoE families."""
    harness._ensure_stubs()  # before transformers is first imported (stubs.py says why)
    import transformers

    module, entry, config_class = MODELS[family]
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        architectures=[entry],
    )
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden_size // 2)
    extra = {
        "qwen2_moe": dict(
            moe,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            shared_expert_intermediate_size=hidden_size,
        ),
        "qwen3_moe": dict(moe, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True),
        "gpt_oss": dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=128,
            swiglu_limit=7.0,  # GPT-OSS's config.json (<= 0.5.20 read it)
            layer_types=["sliding_attention", "full_attention"] * (num_layers // 2)
            + ["sliding_attention"] * (num_layers % 2),
        ),
        "glm4_moe": dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            moe_intermediate_size=hidden_size // 2,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            routed_scaling_factor=1.0,
            norm_topk_prob=True,
            use_qk_norm=False,
            partial_rotary_factor=0.5,
        ),
        # Gemma 3's checkpoints scale the global layers' rope linearly (27B: factor 8),
        # which 0.5.13's class reads.
        "gemma3": dict(rope_scaling={"rope_type": "linear", "factor": 8.0}),
        # Gemma 4 as its small checkpoints (E2B / E4B): sliding and full layers, the
        # per-layer embedding (PLE), the last layers sharing an earlier layer's KV cache.
        "gemma4": dict(
            layer_types=["sliding_attention", "sliding_attention", "full_attention"]
            * (num_layers // 3)
            + ["sliding_attention"] * (num_layers % 3 - 1)
            + ["full_attention"] * (num_layers % 3 > 0),
            sliding_window=4,
            global_head_dim=hidden_size // 4,
            hidden_size_per_layer_input=16,
            vocab_size_per_layer_input=vocab_size,
            num_kv_shared_layers=2,
            enable_moe_block=False,
        ),
        "minimax_m2": dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            use_qk_norm=True,
            rotary_dim=hidden_size // 8,
            scoring_func="sigmoid",
            use_routing_bias=True,
        ),
    }.get(TEXT_OF.get(family, family), {})
    cls = getattr(transformers, config_class, None)
    if cls is None:
        # A transformers older than the family (0.5.9's pin has no MiniMaxM2Config):
        # the checkpoint's own config.json fields, as its remote code reads them.
        cls = transformers.PretrainedConfig
    return cls(**common, **extra)


def _without_cute_dsl_dual_gemm() -> None:
    """0.5.23's Llama MLP picks its decode dual-GEMM mode at construction on CUDA by
    importing the CuTe-DSL kernel module (nvidia-cutlass-dsl, cuda-python), which the
    GPU machine lacks. That kernel runs on SM100 only (its own can_use_dual_gemm), and
    the MLP is stood in here: without the DSL the mode is None, as on a GPU it does
    not run on. Nothing changes where the DSL is installed."""
    import importlib.util

    if importlib.util.find_spec("cutlass") is not None:
        return
    try:
        from sglang.srt.layers import dual_gemm
    except ImportError:  # lines before 0.5.23
        return
    for obj in vars(dual_gemm).values():
        if isinstance(obj, type) and "_select_mode" in vars(obj):
            obj._select_mode = lambda self, *args, **kwargs: None


# Gemma 4's weights outside attention and MLP that are not RMSNorms (harness._norms
# seeds those): the per-layer embedding (PLE) path and each layer's scalar.
GEMMA4_EXTRA = re.compile(
    r"model\.(embed_tokens_per_layer|per_layer_model_projection|per_layer_projection_norm)"
    r"\.weight|model\.layers\.\d+\.(per_layer_input_gate|per_layer_projection"
    r"|post_per_layer_input_norm)\.weight|model\.layers\.\d+\.layer_scalar"
)


def _seed_gemma4(text, g) -> None:
    """Random PLE weights (an embedding N(0, 1), projections N(0, 1/fan_in), norms
    around 1) and layer scalars in [0.5, 1.5): a capture that missed the PLE add or
    the scaling would then differ from the stream (checkpoints' scalars are not 1).
    ``text``: the text model, its weights named as a causal LM's (``model.``...)."""
    import torch

    named = {**dict(text.named_parameters("model")), **dict(text.named_buffers("model"))}
    for name, w in sorted(named.items()):
        if not GEMMA4_EXTRA.fullmatch(name):
            continue
        if name.endswith("layer_scalar"):
            value = 0.5 + torch.rand(w.shape, generator=g)
        elif name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(w.shape, generator=g)
        elif "embed_tokens" in name:
            value = torch.randn(w.shape, generator=g)
        else:
            value = torch.randn(w.shape, generator=g) / w.shape[1] ** 0.5
        w.copy_(value.to(w.dtype))


def _multimodal_config(family: str, text_config):
    """The config ``family``'s SGLang class is built from: the text config, or for
    Gemma 4's multimodal class a Gemma4Config holding it and a one-layer vision tower."""
    if family != "gemma4_mm":
        return text_config
    import transformers

    vision = transformers.Gemma4VisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
    )
    cfg = transformers.Gemma4Config(
        text_config=text_config.to_dict(), vision_config=vision.to_dict(), audio_config=None
    )
    cfg.architectures = [MODELS[family][1]]
    return cfg


def build(
    family: str,
    dtype=None,
    capture_ids=(1, 3, 5),
    seed: int = 3,
    num_layers: int = 7,
    hidden_size: int = 64,
    set_capture: bool = True,
    standin: str | None = None,
):
    import importlib

    import torch

    dtype = dtype or torch.float32
    cfg = tiny_config(family, num_layers, hidden_size)
    harness.setup(dtype=dtype, hf_config=cfg)
    world = harness.tp_world_size()
    standin = standin or ("tanh" if world == 1 else "row_parallel")
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    module, entry, _ = MODELS[family]
    if family in GPU_ONLY_IMPORTS:
        from tests.sglang_real import stubs

        stubs.install(GPU_ONLY_IMPORTS[family])
    cls = getattr(importlib.import_module(f"sglang.srt.models.{module}"), entry)
    _without_cute_dsl_dual_gemm()
    StandIn, RowParallelStandIn = harness._define_modules()
    torch.manual_seed(seed)
    with set_default_torch_dtype(dtype), torch.device("cpu"):
        model = cls(_multimodal_config(family, cfg), quant_config=None)
    model.eval()
    # The text model: ``model`` of a causal LM, ``language_model`` of Gemma 4's multimodal
    # class (which keeps its own lm_head and LogitsProcessor).
    text = model.model if "model" in model._modules else model.language_model
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb = text.embed_tokens.weight
        if world == 1:
            emb.copy_(torch.randn(emb.shape, generator=g).to(emb.dtype))
        else:
            embed = text.embed_tokens
            full = torch.randn((embed.num_embeddings_padded, emb.shape[1]), generator=g)
            embed.weight_loader(emb, full[: embed.org_vocab_size].to(emb.dtype))
        for _, norm in harness._norms(model):
            w = norm.weight
            w.copy_((1.0 + 0.1 * torch.randn(w.shape, generator=g)).to(w.dtype))
        if TEXT_OF.get(family, family) == "gemma4":
            _seed_gemma4(text, g)
    ffn = FFN_ATTR.get(family, "mlp")
    for i, layer in enumerate(text.layers):
        attn_real, ffn_real = layer.self_attn, getattr(layer, ffn)
        if standin == "tanh":
            layer.self_attn = StandIn(hidden_size, seed * 1000 + 2 * i, "attn", attn_real)
            setattr(layer, ffn, StandIn(hidden_size, seed * 1000 + 2 * i + 1, "mlp", ffn_real))
        else:
            with set_default_torch_dtype(dtype):
                layer.self_attn = RowParallelStandIn(
                    hidden_size,
                    seed * 1000 + 2 * i,
                    "attn",
                    attn_real,
                    harness._reduces_itself("attn", attn_real),
                )
                setattr(
                    layer,
                    ffn,
                    RowParallelStandIn(
                        hidden_size,
                        seed * 1000 + 2 * i + 1,
                        "mlp",
                        ffn_real,
                        harness._reduces_itself("mlp", ffn_real),
                    ),
                )
    model.logits_processor = harness._observed_logits_processor(cfg)
    if "model" in model._modules:
        harness._seed_lm_head(model, seed)
    else:
        import types

        harness._seed_lm_head(types.SimpleNamespace(lm_head=model.lm_head, model=text), seed)
        # harness.run / make_batch find the LogitsProcessor and config on harness.text_lm
        # (the language model): the model's own processor, the same object.
        text.logits_processor = model.logits_processor
    if set_capture:
        model.set_eagle3_layers_to_capture(list(capture_ids))
    model._harness_dtype = dtype
    return model
