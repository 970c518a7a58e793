"""Acceptance as users read it: vLLM's own ``LLM`` engine serving the tiny target with
a trained EAGLE-3 draft (tests/data/tiny_eagle3), on CPU, one speculative token,
greedy; the numbers come from vLLM's spec-decode metrics. Run in a child process by
tests/test_vllm_real.py, once with the plugin off and once on:

    python -m tests.vllm_real.acceptance --data tests/data/tiny_eagle3 --work DIR \\
        --case NAME=DRAFT_FOLDER [--case ...] --json OUT

Each case copies a draft folder under ``--work`` (its config as the case writes it)
and serves it in a fresh ``LLM``; the JSON has, per case, vLLM's draft / accepted
counters and every sequence's generated tokens (the test replays the probe on them).
"""

import argparse
import gc
import json
import os
import shutil

PROMPT_LEN, MAX_TOKENS = 16, 32

# What each case writes into the SpecForge draft's config.
CASES = {
    # As SpecForge exported it: eagle_config [1, 3, 5] (output convention). vLLM's V1
    # runner (the CPU one) reads them as capture layers [1, 3, 5]: one layer early.
    "as_exported": {},
    # The doctor's fix for vLLM: the top-level ids [2, 4, 6] (the capture layers).
    "doctor_fix": {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]},
}


def _counter(metrics, name) -> int:
    return int(sum(m.value for m in metrics if m.name == name and hasattr(m, "value")))


def _per_pos(metrics) -> list:
    for m in metrics:
        if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            return [int(v) for v in m.values]
    return []


def run_case(name: str, data: str, work: str, prompts: list) -> dict:
    from vllm import LLM, SamplingParams

    draft = os.path.join(work, name)
    shutil.copytree(os.path.join(data, "draft_specforge"), draft, dirs_exist_ok=True)
    with open(os.path.join(draft, "config.json")) as f:
        config = json.load(f)
    config.update(CASES[name])
    with open(os.path.join(draft, "config.json"), "w") as f:
        json.dump(config, f)
    llm = LLM(model=os.path.join(data, "target"), skip_tokenizer_init=True, dtype="float32",
              max_model_len=256, enforce_eager=True, max_num_seqs=16,
              max_num_batched_tokens=512, gpu_memory_utilization=0.3, disable_log_stats=False,
              speculative_config={"method": "eagle3", "model": draft,
                                  "num_speculative_tokens": 1})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, detokenize=False,
                                       ignore_eos=True))
    metrics = llm.get_metrics()
    result = {"drafts": _counter(metrics, "vllm:spec_decode_num_drafts"),
              "draft_tokens": _counter(metrics, "vllm:spec_decode_num_draft_tokens"),
              "accepted": _counter(metrics, "vllm:spec_decode_num_accepted_tokens"),
              "accepted_per_pos": _per_pos(metrics),
              "outputs": [list(o.outputs[0].token_ids) for o in outs]}
    del llm
    gc.collect()
    return result


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--case", action="append", required=True, choices=sorted(CASES))
    p.add_argument("--json", required=True)
    args = p.parse_args()
    os.makedirs(args.work, exist_ok=True)
    with open(os.path.join(args.data, "prompts.jsonl")) as f:
        prompts = [json.loads(line)["token_ids"][:PROMPT_LEN] for line in f if line.strip()]
    results = {"prompts": prompts}
    for name in args.case:
        results[name] = run_case(name, args.data, args.work, prompts)
        print(f"ACCEPTANCE {name}: {results[name]['accepted']} of "
              f"{results[name]['draft_tokens']} draft tokens", flush=True)
    with open(args.json, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
