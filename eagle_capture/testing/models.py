"""The tiny DeepSeek-V3 config every model-level test builds on.

The features of DeepSeek-V3 / Kimi-K2 that shape the capture, at toy sizes:
MLA attention with a q LoRA, yarn rope, dense layers before MoE layers
(routed + shared experts, SGLang's noaux_tc sigmoid gate), untied lm_head.
Random init, no download; HF transformers 4.x and 5.x spell rope differently.
"""


def tiny_deepseek_v3_config(
    num_layers: int = 6,
    hidden_size: int = 64,
    vocab_size: int = 128,
    first_k_dense_replace: int = 2,
):
    import transformers

    rope = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        first_k_dense_replace=first_k_dense_replace,
        moe_layer_freq=1,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        architectures=["DeepseekV3ForCausalLM"],
        # As in DeepSeek-V3's config.json (SGLang's MoEGate reads them; the
        # transformers class does not define all of them).
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
    )
    if int(transformers.__version__.split(".")[0]) >= 5:
        return transformers.DeepseekV3Config(
            rope_parameters=dict(rope, rope_theta=10000.0), **common
        )
    legacy = dict(rope)
    legacy["type"] = legacy.pop("rope_type")
    return transformers.DeepseekV3Config(rope_theta=10000.0, rope_scaling=legacy, **common)
