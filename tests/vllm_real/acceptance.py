"""Acceptance as users read it: vLLM's own ``LLM`` engine serving the tiny target with
a trained EAGLE-3 draft (tests/data/tiny_eagle3), on CPU, one speculative token,
greedy; the numbers come from vLLM's spec-decode metrics. The plugin is on or off
for the whole process (vLLM loads plugins once per process), so
tests/test_vllm_real.py runs the cases twice: with the plugin on after
tests/vllm_real/engine.py's own run (``run_cases``, one vLLM import for both), and
with it off in a process forked from the vLLM fork server:

    EAGLE_CAPTURE=0 python -m tests.vllm_real.acceptance --data tests/data/tiny_eagle3 \\
        --work DIR --json OUT --plugin off --case as_exported --case doctor_fix

Each case copies the SpecForge draft under ``work`` with its config as the case
writes it and serves it in a fresh in-process ``LLM``; the JSON has, per case,
vLLM's draft / accepted counters and every sequence's generated tokens (the test
replays the probe's step on them). Each case's log starts with
``EAGLE_CAPTURE_CASE <case> plugin <on|off>``.
"""

import argparse
import gc
import json
import os
import shutil
import sys

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

    from tests.vllm_real.harness import attention_backend

    draft = os.path.join(work, "draft")
    shutil.copytree(os.path.join(data, "draft_specforge"), draft, dirs_exist_ok=True)
    with open(os.path.join(draft, "config.json")) as f:
        config = json.load(f)
    config.update(CASES[name])
    with open(os.path.join(draft, "config.json"), "w") as f:
        json.dump(config, f)
    llm = LLM(
        model=os.path.join(data, "target"),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        gpu_memory_utilization=0.3,
        disable_log_stats=False,
        **attention_backend(os.path.join(data, "target")),
        speculative_config={
            "method": "eagle3",
            "model": draft,
            "num_speculative_tokens": 1,
            **attention_backend(draft),
        },
    )
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=MAX_TOKENS, temperature=0, detokenize=False, ignore_eos=True),
    )
    metrics = llm.get_metrics()
    result = {
        "drafts": _counter(metrics, "vllm:spec_decode_num_drafts"),
        "draft_tokens": _counter(metrics, "vllm:spec_decode_num_draft_tokens"),
        "accepted": _counter(metrics, "vllm:spec_decode_num_accepted_tokens"),
        "accepted_per_pos": _per_pos(metrics),
        "outputs": [list(o.outputs[0].token_ids) for o in outs],
    }
    del llm
    gc.collect()
    return result


def run_cases(data: str, work: str, out: str, cases, plugin: str) -> None:
    """``cases`` in this process (``plugin``: whether it loaded the plugin on, for the
    record), the trainer's own convention for the plugin's id check (auto)."""
    os.makedirs(work, exist_ok=True)
    os.environ.update(EAGLE_CAPTURE_ID_CONVENTION="auto", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    with open(os.path.join(data, "prompts.jsonl")) as f:
        prompts = [json.loads(line)["token_ids"][:PROMPT_LEN] for line in f if line.strip()]
    results = {"prompts": prompts, "plugin": plugin}
    for name in cases:
        print(f"EAGLE_CAPTURE_CASE {name} plugin {plugin}", flush=True)
        sys.stderr.flush()
        r = results[name] = run_case(name, data, os.path.join(work, name), prompts)
        print(
            f"ACCEPTANCE {name} plugin {plugin}: {r['accepted']} of {r['draft_tokens']} draft "
            f"tokens",
            flush=True,
        )
    with open(out, "w") as f:
        json.dump(results, f)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--json", required=True)
    p.add_argument(
        "--plugin",
        choices=("on", "off"),
        required=True,
        help="what EAGLE_CAPTURE says in this process (recorded)",
    )
    p.add_argument("--case", action="append", choices=sorted(CASES), required=True)
    args = p.parse_args()
    run_cases(args.data, args.work, args.json, args.case, args.plugin)


if __name__ == "__main__":
    main()
