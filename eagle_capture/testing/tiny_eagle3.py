"""A tiny target and EAGLE-3 drafts trained on it, on CPU in a few minutes: the
probe's test data (``tests/data/tiny_eagle3``, written by
``python -m eagle_capture.testing.tiny_eagle3 --out DIR``).

The target is an 8-layer Llama (hidden 64, vocabulary 512) with random weights,
wide enough at init (``initializer_range`` 0.05) that each layer moves the residual
stream visibly. Its training text is its own: sequences sampled from it at
temperature 0.7 from random 4-token starts. Each draft is one EAGLE-3 layer
(2 query heads, 1 key/value head: GQA; a 256-token draft vocabulary with ``d2t``)
trained as SpecForge's first step trains it: at position t it gets the target's
states at its capture layers at t and the token at t + 1, and learns the target's
greedy token at t + 1 (cross-entropy on the draft vocabulary). Weights are kept
in bfloat16 (rounded before the data is made, so the fp32 load is exact).

Three drafts, on different layers so that no convention's reading can pass for
another's:

* ``draft_specforge``: SpecForge's export (``LlamaForCausalLMEagle3``,
  ``midlayer.*``, ``eagle_config`` ids [1, 3, 5] in the output convention):
  trained on capture layers [2, 4, 6];
* ``draft_speculators``: speculators' export (``Eagle3Speculator``, ``layers.0.*``,
  top-level ids [1, 3, 6] in the input convention): trained on capture layers
  [1, 3, 6];
* ``draft_torchspec_mla``: TorchSpec's Kimi-K2.5 MLA export (``Eagle3DeepseekV2ForCausalLM``,
  ``layers.0.*``, ``eagle_config`` ids [2, 4, 6] in the output convention): one layer with
  DeepSeek MLA attention (q_lora 32, kv_lora 256, YaRN factor 64 as published), trained on
  capture layers [3, 5, 7], its step computed as SGLang computes it.

The configs follow the files each trainer's own exporter wrote
(``tests/data/trainer_configs``), resized. Deterministic for a given torch build
(fixed seeds, one thread); the committed files are the reference, and
MANIFEST.json records how they were made and what the probe measured on them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

NUM_LAYERS = 8
HIDDEN = 64
VOCAB = 512
DRAFT_VOCAB = 256
SEQ_LEN = 64
TARGET_SEED, DATA_SEED, DRAFT_SEED = 0, 1, 2

TARGET_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "initializer_range": 0.05,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "attention_bias": False,
    "mlp_bias": False,
}

DRAFT_LAYER = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": 128,
    "max_position_embeddings": 256,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "num_key_value_heads": 1,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": VOCAB,
}

# TorchSpec's Kimi-K2.5 MLA draft template (configs/draft_models/kimi_k25_eagle3_mla.json,
# kept verbatim in tests/data/published_configs) resized: MLA with q_lora / kv_lora ranks and
# its YaRN rope scaling as published. kv_lora_rank + qk_rope_head_dim = 320: a latent head
# size vLLM's CPU MLA attention takes (320, 512 or 576), so vLLM can serve this draft on CPU.
MLA_DRAFT_LAYER = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"],
    "model_type": "kimi_k2",
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 64,
    "v_head_dim": 32,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "vocab_size": VOCAB,
    "draft_vocab_size": DRAFT_VOCAB,
    "torch_dtype": "bfloat16",
    "rope_theta": 50000.0,
    "rope_scaling": {
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "factor": 64.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
}

# (folder, trainer format, ids as the trainer writes them, capture layers trained on)
DRAFTS = (
    ("draft_specforge", "SpecForge", [1, 3, 5], [2, 4, 6]),
    ("draft_speculators", "speculators", [1, 3, 6], [1, 3, 6]),
    ("draft_torchspec_mla", "TorchSpec MLA", [2, 4, 6], [3, 5, 7]),
)
# Weight groups of a draft layer as the trainers name them (self_attn.*, mlp.*).
_ATTENTION = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "q_a_proj",
    "q_a_layernorm",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_a_layernorm",
    "kv_b_proj",
)


def save_draft(draft, folder, config: dict, fmt: str = "SpecForge") -> None:
    """Write ``draft`` as a trainer would: SpecForge's ``midlayer.*`` names or
    ``layers.0.*`` (speculators, Model Optimizer), ``d2t`` and ``t2d`` (test data)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in draft.state_dict().items():
        if name.startswith("rotary."):
            continue
        if name.startswith("layers."):
            i, rest = name.split(".", 2)[1:]
            group = (
                "mlp."
                if rest.split(".")[0] in ("gate_proj", "up_proj", "down_proj")
                else "self_attn."
                if rest.split(".")[0] in _ATTENTION
                else ""
            )
            prefix = "midlayer." if fmt == "SpecForge" and i == "0" else f"layers.{i}."
            name = prefix + group + rest
        state[name] = tensor.detach().contiguous()
    if draft.embed_tokens is not None:
        state["embed_tokens.weight"] = draft.embed_tokens.weight.detach().contiguous()
    t2d = torch.zeros(draft.spec.vocab_size, dtype=torch.bool)
    t2d[draft.to_target(torch.arange(draft.spec.draft_vocab_size))] = True
    state["t2d"] = t2d
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def specforge_config(ids) -> dict:
    """SpecForge 0.2.0's export (``export_to_sglang``) of a draft made from its template."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        **DRAFT_LAYER,
        "dtype": "bfloat16",
        "draft_vocab_size": DRAFT_VOCAB,
        "pad_token_id": 0,
        "rope_theta": 10000.0,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(ids),
            "use_aux_hidden_state": True,
        },
    }


def speculators_config(ids) -> dict:
    """speculators 0.9.0's ``Eagle3SpeculatorConfig.save_pretrained``."""
    return {
        "architectures": ["Eagle3Speculator"],
        "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": DRAFT_VOCAB,
        "eagle_aux_hidden_state_layer_ids": list(ids),
        "embed_requires_grad": False,
        "fc_norm": False,
        "norm_before_fc": False,
        "norm_before_residual": False,
        "norm_output": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {
                    "accept_tolerance": 0.0,
                    "proposal_type": "greedy",
                    "speculative_tokens": 3,
                    "verifier_accept_k": 1,
                }
            ],
            "verifier": {
                "architectures": ["LlamaForCausalLM"],
                "name_or_path": "tiny_eagle3/target",
            },
        },
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "target_hidden_size": None,
        "transformer_layer_config": dict(DRAFT_LAYER),
    }


def torchspec_mla_config(ids) -> dict:
    """TorchSpec's MLA template resized (MLA_DRAFT_LAYER) with its eagle_config: ids in the
    output convention, as TorchSpec's native export writes them."""
    return {
        **MLA_DRAFT_LAYER,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(ids),
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
            "use_last_layernorm": True,
            "use_mtp_layernorm": False,
        },
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }


def config_for(fmt: str, ids) -> dict:
    """The config a draft of trainer format ``fmt`` (DRAFTS) is saved with."""
    return {
        "SpecForge": specforge_config,
        "speculators": speculators_config,
        "TorchSpec MLA": torchspec_mla_config,
    }[fmt](ids)


def new_draft(config: dict, fmt: str):
    """An untrained draft for ``config``: the probe's own step module (its Llama layer,
    or its MLA layer for Eagle3DeepseekV2ForCausalLM, read as the probe reads it with
    its target in transformers)."""
    from eagle_capture.probe.draft import MLA_DRAFTS, DraftSpec, Eagle3Draft

    spec = DraftSpec.from_config(config, "speculators" if fmt == "speculators" else fmt)
    if config["architectures"][0] in MLA_DRAFTS:
        from eagle_capture.probe.mla_draft import mla_draft

        return mla_draft(config, spec)
    return Eagle3Draft(spec)


def _bf16_round(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16).float())


def make_target():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(TARGET_SEED)
    model = LlamaForCausalLM(LlamaConfig(**TARGET_CONFIG)).eval()
    _bf16_round(model)
    return model


@torch.no_grad()
def sample(target, n: int, seed: int, temperature: float = 0.7) -> torch.Tensor:
    """``n`` sequences of SEQ_LEN tokens: 4 random tokens, then the target's own
    samples (one token at a time through its KV cache)."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(3, VOCAB, (n, 4), generator=g)
    out = target(input_ids=seq, use_cache=True)
    while True:
        logits = out.logits[:, -1].float()
        nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g)
        seq = torch.cat([seq, nxt], 1)
        if seq.shape[1] == SEQ_LEN:
            return seq
        out = target(input_ids=nxt, past_key_values=out.past_key_values, use_cache=True)


@torch.no_grad()
def states_and_greedy(target, seq: torch.Tensor, batch: int = 256):
    """The states at every capture layer [N + 1, B, T, H] (the probe's own hooks) and
    the target's greedy tokens [B, T]."""
    from eagle_capture.probe.target import decoder_layers, target_states

    layers = decoder_layers(target, NUM_LAYERS)
    parts = [
        target_states(target, layers, seq[b : b + batch], range(NUM_LAYERS + 1))
        for b in range(0, len(seq), batch)
    ]
    states = torch.stack([torch.cat([p[0][c] for p in parts]) for c in range(NUM_LAYERS + 1)])
    return states, torch.cat([p[1] for p in parts])


def draft_vocabulary(greedy: torch.Tensor) -> torch.Tensor:
    """SpecForge's d2t: the DRAFT_VOCAB most frequent target tokens (ascending ids),
    stored as offsets (target id = draft id + d2t[draft id])."""
    counts = torch.bincount(greedy.flatten(), minlength=VOCAB)
    top = torch.sort(torch.argsort(counts, descending=True, stable=True)[:DRAFT_VOCAB]).values
    return top - torch.arange(DRAFT_VOCAB)


def train_draft(
    config: dict,
    fmt: str,
    capture: list[int],
    states,
    greedy,
    seq,
    embed,
    steps: int = 1200,
    batch: int = 64,
    log=print,
):
    torch.manual_seed(DRAFT_SEED)
    draft = new_draft(config, fmt)
    draft.d2t.copy_(draft_vocabulary(greedy))
    t2d = torch.full((VOCAB,), -1, dtype=torch.long)
    t2d[draft.to_target(torch.arange(DRAFT_VOCAB))] = torch.arange(DRAFT_VOCAB)
    aux = torch.cat([states[c][:, :-1] for c in capture], -1)
    embeds = embed(seq[:, 1:]).detach()
    labels = t2d[greedy[:, 1:]]  # -1: outside the draft vocabulary
    positions = torch.arange(SEQ_LEN - 1).unsqueeze(0).expand(batch, -1)
    opt = torch.optim.AdamW(draft.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    g = torch.Generator().manual_seed(DRAFT_SEED)
    for step in range(steps):
        idx = torch.randint(0, len(seq), (batch,), generator=g)
        logits = draft(aux[idx], embeds[idx], positions)
        loss = F.cross_entropy(
            logits.reshape(-1, DRAFT_VOCAB), labels[idx].reshape(-1), ignore_index=-1
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 200 == 0 or step == steps - 1:
            log(f"  {fmt} draft on {capture}: step {step}, loss {loss.item():.3f}")
    _bf16_round(draft)
    return draft.eval()


def build(
    out: Path, train_sequences: int = 3072, eval_sequences: int = 64, steps: int = 1200, log=print
) -> dict:
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    started = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    target = make_target()
    tdir = out / "target"
    tdir.mkdir(exist_ok=True)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in target.state_dict().items()},
        str(tdir / "model.safetensors"),
        metadata={"format": "pt"},
    )
    (tdir / "config.json").write_text(
        json.dumps({**TARGET_CONFIG, "dtype": "bfloat16"}, indent=2) + "\n"
    )
    log(f"target written; sampling {train_sequences} + {eval_sequences} sequences")
    seq = sample(target, train_sequences, DATA_SEED)
    held_out = sample(target, eval_sequences, DATA_SEED + 100)
    with open(out / "prompts.jsonl", "w") as f:
        for row in held_out.tolist():
            f.write(json.dumps({"token_ids": row}) + "\n")
    states, greedy = states_and_greedy(target, seq)
    manifest = {
        "made_by": "python -m eagle_capture.testing.tiny_eagle3 --out DIR",
        "torch": torch.__version__,
        "train_sequences": train_sequences,
        "eval_sequences": eval_sequences,
        "seq_len": SEQ_LEN,
        "steps": steps,
        "seeds": {"target": TARGET_SEED, "data": DATA_SEED, "draft": DRAFT_SEED},
        "drafts": {},
    }
    embed = target.get_input_embeddings()
    for folder, fmt, ids, capture in DRAFTS:
        config = config_for(fmt, ids)
        draft = train_draft(config, fmt, capture, states, greedy, seq, embed, steps, log=log)
        save_draft(draft, out / folder, config, fmt)
        manifest["drafts"][folder] = {
            "format": fmt,
            "ids_written": ids,
            "trained_on_capture_layers": capture,
        }
    manifest["seconds"] = round(time.monotonic() - started, 1)
    # What the probe measures on the held-out prompts: the margins the tests assert.
    from eagle_capture.probe.probe import run_probe

    for folder, *_ in DRAFTS:
        report = run_probe(
            str(tdir),
            str(out / folder),
            str(out / "prompts.jsonl"),
            log=lambda s: None,
            progress=False,
        )
        manifest["drafts"][folder]["probe"] = {
            "verdict": report.verdict.split(":")[0],
            "agreement": {str(list(c.layers)): round(c.agreement, 4) for c in report.ranked},
            "tokens": report.ranked[0].tokens,
        }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--train-sequences", type=int, default=3072)
    p.add_argument("--steps", type=int, default=1200)
    args = p.parse_args(argv)
    manifest = build(Path(args.out), args.train_sequences, steps=args.steps)
    print(json.dumps(manifest, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
