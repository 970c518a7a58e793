"""vLLM's own engine (``LLM``) with an EAGLE-3 draft, on CPU, with the plugin
found by vLLM's plugin loader in the engine-core and worker processes it
starts; run in a child process by tests/test_vllm_real.py:

    EAGLE_CAPTURE=1 EAGLE_CAPTURE_VERIFY=3 python -m tests.vllm_real.engine --work DIR

The target is a tiny DeepSeek-V3 with vLLM's CPU MLA attention, asked for by name (its head
dim kv_lora_rank + qk_rope_head_dim must be 320, 512 or 576; harness.attention_backend says
why not the AMX one) and dummy weights;
the draft is vLLM's Eagle3DeepseekV2ForCausalLM (model_type deepseek_v2: with
deepseek_v3 vLLM rewrites it into an MTP model). Prints the generated tokens;
the test reads the log lines of every process. With ``--acceptance-json``, then the
acceptance runs of tests/vllm_real/acceptance.py (the tiny trained target and draft;
one vLLM import for both).
"""

import argparse
import json
import os

TARGET = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_shared_experts": 1,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 96,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "qk_nope_head_dim": 64,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "attention_bias": False,
    "num_nextn_predict_layers": 0,
}
DRAFT_IDS = [1, 4, 8]


def write(folder: str, config: dict) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("--compiled", action="store_true")
    p.add_argument("--acceptance-json", help="then the acceptance runs, written here")
    args = p.parse_args()
    target = write(os.path.join(args.work, "target"), TARGET)
    draft = write(
        os.path.join(args.work, "draft"),
        dict(
            TARGET,
            architectures=["Eagle3DeepseekV2ForCausalLM"],
            model_type="deepseek_v2",
            num_hidden_layers=1,
            draft_vocab_size=1024,
            eagle_config={"eagle_aux_hidden_state_layer_ids": DRAFT_IDS},
        ),
    )

    from vllm import LLM, SamplingParams

    from tests.vllm_real.harness import attention_backend

    llm = LLM(
        model=target,
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype="float32",
        max_model_len=256,
        enforce_eager=not args.compiled,
        max_num_seqs=4,
        gpu_memory_utilization=0.3,
        max_num_batched_tokens=256,
        **attention_backend(target),
        speculative_config={
            "method": "eagle3",
            "model": draft,
            "num_speculative_tokens": 2,
            **attention_backend(draft),
        },
    )
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, {"prompt_token_ids": [11, 12, 13]}]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, detokenize=False))
    print(
        "EAGLE_CAPTURE_TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True
    )
    if args.acceptance_json:
        from tests.vllm_real.acceptance import run_cases

        del llm
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        run_cases(
            os.path.join(root, "tests", "data", "tiny_eagle3"),
            os.path.join(args.work, "acceptance"),
            args.acceptance_json,
            ["doctor_fix"],
            "on",
        )


if __name__ == "__main__":
    main()
