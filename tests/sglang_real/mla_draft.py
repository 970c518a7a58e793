"""The probe's MLA draft step (eagle_capture/probe/mla_draft.py) against SGLang's own
``Eagle3DeepseekV2ForCausalLM`` (``sglang.srt.models.kimi_k25_eagle3``, 0.5.13+), on CPU,
in one SGLang line per process (tests/test_mla_draft.py):

    PYTHONPATH=$(tools/sglang_real_env.sh 0.5.13):. python -m tests.sglang_real.mla_draft \\
        --json OUT --work DIR

Real: the process set-up of tests/sglang_real/harness.py; the draft config read by
transformers' AutoConfig after SGLang's own config registry (model_type kimi_k2 -> its
DeepseekV3Config alias); the class built from it, its own ``load_weights`` (q_a_proj and
kv_a_proj_with_mqa fused, midlayer renamed, d2t -> hot_token_id) and
``post_load_weights`` (kv_b_proj split into w_kc / w_vc); ``Eagle3MLAModel.forward`` as an
EAGLE-3 draft-extend batch runs it: fc, the two norms and the concat, the attention
communicator's qkv latent, ``DeepseekV2AttentionMLA``'s dispatch (MLA, absorbed, for a
draft-extend batch) with its own rotary embedding (DeepSeek YaRN) and softmax scale, the
absorbed bmm's, o_proj, the MLP and the final norm.

Stood in: the attention kernel only (``attn_mqa``, a RadixAttention whose backend needs a
KV-cache pool): causal softmax attention over the latent keys and values SGLang hands it,
with SGLang's own scale. The logits are the model's output hidden states times its
``lm_head`` weight (the LogitsProcessor's last-row selection is not what a first step over
every position needs).

Cases: the tiny trained draft of tests/data/tiny_eagle3 (TorchSpec's Kimi-K2.5 MLA template
resized, its YaRN scaling as published) at positions from 0 and from 3000; and random
drafts whose configs use the keys the engines read differently (fc_norm via use_aux_norm,
attn_factor, no rope scaling, apply_yarn_scaling off; no q_lora_rank, which SGLang refuses). Not run here:
``rope_interleave: false`` (neox halves): SGLang's DeepseekScalingRotaryEmbedding
``forward_native`` cannot run it (its ``cos.repeat(1, 1, 2)`` makes the [T, R/2] table
4-D), so only its CUDA kernel does; the probe follows the kernel's rotation.
"""

import argparse
import json
import os
import shutil
import sys
import time
import traceback
import types
from pathlib import Path

import torch

from tests.sglang_real import harness

ROOT = Path(__file__).resolve().parents[2]
TRAINED = ROOT / "tests" / "data" / "tiny_eagle3" / "draft_torchspec_mla"
# fp32: SGLang absorbs kv_b_proj into the query and output (bmm's over the latent), the
# probe multiplies out each head's keys and values: the same sums in another order.
RTOL = 1e-4


class _CausalLatentAttention(torch.nn.Module):
    """``attn_mqa``'s kernel: q [T, H, L + R] against one shared latent key [T, 1, L + R]
    and value [T, 1, L] (``q_rope`` / ``k_rope`` when the backend takes them apart)."""

    def __init__(self, real):
        super().__init__()
        self.heads, self.scaling = real.tp_q_head_num, real.scaling
        self.v_dim = real.v_head_dim
        self.calls = 0

    def forward(self, q, k, v, forward_batch, q_rope=None, k_rope=None, **kwargs):
        if q_rope is not None:
            q, k = torch.cat([q, q_rope], -1), torch.cat([k, k_rope], -1)
        t = q.shape[0]
        q = q.reshape(t, self.heads, -1).transpose(0, 1)
        k = k.reshape(t, 1, -1).transpose(0, 1).expand(self.heads, -1, -1)
        v = v.reshape(t, 1, -1)[..., : self.v_dim].transpose(0, 1).expand(self.heads, -1, -1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.scaling
        )
        self.calls += 1
        return o.transpose(0, 1).reshape(t, -1)


def _sglang_draft(folder: Path):
    from sglang.srt.models import deepseek_v2, kimi_k25_eagle3
    from transformers import AutoConfig

    # SGLang's config registry: model_type kimi_k2 -> its DeepseekV3Config alias.
    try:
        from sglang.srt.utils.hf_transformers import common  # noqa: F401  0.5.13+
    except ImportError:
        from sglang.srt.utils import hf_transformers_utils  # noqa: F401
    config = AutoConfig.from_pretrained(str(folder))
    # On a CPU server SGLang builds DeepSeek YaRN rope only (get_rope_cpu asserts a
    # scaling); a GPU host builds the others with get_rope, whose classes run their native
    # torch path on CPU tensors: built as on a GPU host where the CPU path cannot.
    params = getattr(config, "rope_parameters", None) or {}
    real = deepseek_v2.get_rope_wrapper
    if params.get("rope_type", "default") == "default":  # SGLang's own test
        deepseek_v2.get_rope_wrapper = lambda *a, **k: real(*a, **{**k, "device": "cuda"})
    try:
        model = kimi_k25_eagle3.Eagle3DeepseekV2ForCausalLM(config).float().eval()
    finally:
        deepseek_v2.get_rope_wrapper = real
    from eagle_capture.probe.draft import read_weights

    model.load_weights(read_weights(folder).items())
    attn = model.model.midlayer.self_attn
    attn.attn_mqa = _CausalLatentAttention(attn.attn_mqa)
    return model, config


def _batch(aux: torch.Tensor):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    # An EAGLE-3 draft's first forward after the target's prefill: DRAFT_EXTEND (0.5.23 has
    # only the spec-v2 worker's DRAFT_EXTEND_V2).
    mode = getattr(ForwardMode, "DRAFT_EXTEND", None) or ForwardMode.DRAFT_EXTEND_V2
    return types.SimpleNamespace(
        forward_mode=mode,
        spec_info=types.SimpleNamespace(hidden_states=aux),
        mm_input_embeds=None,
        contains_mm_inputs=lambda: False,
        extend_prefix_lens_cpu=[0],
        seq_lens_cpu=torch.tensor([aux.shape[0]]),
        attn_cp_metadata=None,
        dsa_cp_metadata=None,
        out_cache_loc=None,
        batch_size=1,
    )


def _forward_context():
    """0.5.23 reads the attention backend's name from the forward context the model runner
    sets: a backend naming none (the server args' default decides, as for a runner that
    stamps none). Its kernel is stood in anyway (attn_mqa)."""
    import contextlib

    from sglang.srt.model_executor import forward_context as fc

    if not hasattr(fc, "forward_context"):
        return contextlib.nullcontext()
    backend = types.SimpleNamespace(
        prefill_attention_backend_str=None, decode_attention_backend_str=None
    )
    return fc.forward_context(fc.ForwardContext(attn_backend=backend))


def compare(folder: Path, start: int = 0, t: int = 23, seed: int = 0) -> dict:
    """SGLang's draft and the probe's (``engine="sglang"``) on the same target states,
    embeddings and positions ``start`` .. ``start + t - 1``: logits and d2t-mapped tokens."""
    from eagle_capture.probe.draft import load_draft

    model, config = _sglang_draft(folder)
    ours = load_draft(folder, engine="sglang")
    g = torch.Generator().manual_seed(seed)
    h = config.hidden_size
    aux = torch.randn(t, ours.spec.num_aux * h, generator=g) * 2
    embeds = torch.randn(t, h, generator=g) * 0.05
    positions = torch.arange(start, start + t)
    with torch.no_grad(), _forward_context():
        hidden, _ = model.model(
            torch.zeros(t, dtype=torch.long), positions, _batch(aux), input_embeds=embeds
        )
        theirs = hidden @ model.lm_head.weight.T
        mine = ours(aux.unsqueeze(0), embeds.unsqueeze(0), positions.unsqueeze(0))[0]
    attn = model.model.midlayer.self_attn
    assert attn.attn_mqa.calls == 1, "SGLang's absorbed MLA path was not the one that ran"
    scale = theirs.abs().max().item()
    diff = (theirs - mine).abs().max().item()
    hot = model.hot_token_id if model.hot_token_id is not None else torch.arange(theirs.shape[-1])
    tokens_theirs, tokens_mine = hot[theirs.argmax(-1)], ours.to_target(mine.argmax(-1))
    assert diff <= RTOL * scale, f"logits differ by {diff} (largest {scale})"
    assert torch.equal(tokens_theirs, tokens_mine), (tokens_theirs, tokens_mine)
    return {
        "max_abs_diff": diff,
        "largest": scale,
        "tokens": t,
        "softmax_scale": [attn.scaling, ours.reading.softmax_scale],
    }


def _variant(work: Path, name: str, edit) -> Path:
    """A random draft (the trained draft's shapes) saved with an edited config."""
    from eagle_capture.testing import tiny_eagle3

    config = tiny_eagle3.torchspec_mla_config([2, 4, 6])
    edit(config)
    torch.manual_seed(len(name))
    draft = tiny_eagle3.new_draft(config, "TorchSpec MLA")
    with torch.no_grad():
        for n, p in draft.named_parameters():
            p.copy_(
                1 + 0.1 * torch.randn_like(p)
                if n.endswith("norm.weight")
                else torch.randn_like(p) / p.shape[-1] ** 0.5
            )
        draft.d2t.copy_(torch.randint(0, 256, (256,)))
    folder = work / name
    shutil.rmtree(folder, ignore_errors=True)
    tiny_eagle3.save_draft(draft, folder, config, "TorchSpec MLA")
    return folder


def no_q_lora_refused() -> dict:
    """Without q_lora_rank SGLang's class refuses the draft (vLLM runs it with q_proj): the
    probe's SGLang reading says so, in SGLang's words."""
    from eagle_capture.probe.draft import DraftError, load_draft

    folder = _variant(
        Path(os.environ.get("TMPDIR", "/tmp")) / "mla_no_q_lora",
        "no_q_lora",
        lambda c: c.update(q_lora_rank=None),
    )
    try:
        _sglang_draft(folder)
        raise AssertionError("SGLang built a draft without q_lora_rank")
    except ValueError as exc:
        theirs = str(exc)
    try:
        load_draft(folder, engine="sglang")
        raise AssertionError("the probe's SGLang reading took a draft without q_lora_rank")
    except DraftError as exc:
        assert theirs in str(exc), (theirs, str(exc))
    load_draft(folder, engine="vllm")
    return {"sglang": theirs}


VARIANTS = {
    # SGLang's keys: its legacy fc_norm flag, attn_factor on cos / sin, other YaRN betas.
    "aux_norm_attn_factor": lambda c: (
        c.update(use_aux_norm=True),
        c["rope_scaling"].update(attn_factor=0.8, mscale=0.7, beta_fast=32.0),
    ),
    "no_rope_scaling": lambda c: c.pop("rope_scaling"),
    "fc_norm_yarn_scaling_off": lambda c: (
        c.update(fc_norm=True),
        c["rope_scaling"].update(apply_yarn_scaling=False, mscale_all_dim=0.5),
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--work", required=True)
    args = parser.parse_args()
    harness.setup()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cases = {
        "trained_from_0": lambda: compare(TRAINED, 0),
        "trained_from_3000": lambda: compare(TRAINED, 3000),
    }
    for name, edit in VARIANTS.items():
        cases[name] = lambda name=name, edit=edit: compare(_variant(work, name, edit), 5)
    cases["no_q_lora_refused"] = no_q_lora_refused
    results = {"version": harness.sglang_version()}
    for name, fn in cases.items():
        start = time.perf_counter()
        try:
            results[name] = {"ok": True, **fn()}
        except Exception as e:  # noqa: BLE001 - reported per case
            results[name] = {
                "ok": False,
                "detail": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
        print(f"MLA_DRAFT {name}: {results[name]}", file=sys.stderr, flush=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1, default=str)
    os._exit(0)


if __name__ == "__main__":
    main()
