"""The fused EAGLE-3 capture inside an SGLang-style DeepseekV2 layer loop, on CPU.

    python examples/layer_loop.py

Builds a tiny Hugging Face DeepseekV3 model (random weights), runs its layers the
way SGLang's DeepseekV2 loop does (each layer starts with the in-place
add+RMSNorm of hidden states and residual), captures the draft's layers into one
preallocated buffer with eagle_capture's fused ops, and checks the result against
what the draft is trained on: HF ``output_hidden_states`` for the draft's ids.
The part between the ``readme`` markers is the README's example, verbatim
(tests/test_examples.py checks that, and runs this file).
"""

import transformers

# [readme-start]
import torch
import eagle_capture as ec
from eagle_capture.layer_ids.plan import build_plan


@torch.no_grad()
def run_layers(model, input_ids, draft_ids, max_tokens=256):
    """SGLang's DeepseekV2 layer loop over an HF ``DeepseekV3Model``, capturing
    the draft's layers; returns ``[T, K*H]``, what ``torch.cat(aux, -1)`` gave."""
    # Draft ids are SpecForge's: id X = output of layer X. The plan turns them into
    # capture layers (SGLang's layers_to_capture: input to layer X + 1) and slots.
    plan = build_plan(draft_ids, len(model.layers))
    hidden = model.embed_tokens(input_ids)[0]                      # [T, H]
    buf = plan.make_buffer(max_tokens, hidden.shape[1], dtype=hidden.dtype,
                           device=hidden.device)                   # [max_tokens, K, H]
    positions = model.rotary_emb(hidden[None], torch.arange(hidden.shape[0])[None])
    eps = model.norm.variance_epsilon
    residual = None
    for i, layer in enumerate(model.layers):
        w = layer.input_layernorm.weight
        if residual is None:            # layer 0: its input is the embedding output
            if buf.captures_layer(i):
                buf.capture(i, hidden, None)
            residual = hidden.clone()
            hidden = layer.input_layernorm(hidden)
        elif buf.captures_layer(i):     # the capture is the residual this norm writes
            buf.add_rmsnorm_capture(i, hidden, residual, w, eps)
        else:
            ec.add_rmsnorm_capture(hidden, residual, w, eps)
        hidden = layer.self_attn(hidden[None], position_embeddings=positions,
                                 attention_mask=None)[0][0].contiguous()
        ec.add_rmsnorm_capture(hidden, residual, layer.post_attention_layernorm.weight, eps)
        hidden = layer.mlp(hidden[None])[0].contiguous()
    return buf.result(hidden.shape[0])                             # a view: no copy
# [readme-end]


def tiny_deepseek_v3(num_layers=6, seed=0):
    torch.manual_seed(seed)
    config = transformers.DeepseekV3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6)
    config._attn_implementation = "sdpa"
    model = transformers.DeepseekV3Model(config).eval()
    with torch.no_grad():   # random init leaves norms at 1: perturb so a wrong weight shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def main() -> int:
    model = tiny_deepseek_v3()
    input_ids = torch.randint(0, 97, (1, 9), generator=torch.Generator().manual_seed(1))
    draft_ids = [1, 2, 4]                           # SpecForge-style: outputs of layers 1, 2, 4
    aux = run_layers(model, input_ids, draft_ids)
    with torch.no_grad():                           # the training side (SpecForge)
        states = model(input_ids=input_ids, output_hidden_states=True).hidden_states
    trained = torch.cat([states[i + 1][0] for i in draft_ids], dim=-1)
    err = (aux - trained).abs().max().item()
    print(f"captured {tuple(aux.shape)} for draft ids {draft_ids}; "
          f"max |fused - HF output_hidden_states| = {err:.2e}")
    if err > 1e-5:
        print("MISMATCH: the capture is not what the draft was trained on")
        return 1
    print("ok: the fused capture equals what the draft was trained on")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
