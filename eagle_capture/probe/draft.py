"""An EAGLE-3 draft's first speculative step, in torch, loaded from any trainer's export.

The step, as the engines' EAGLE-3 Llama draft classes run it (vLLM's
``Eagle3LlamaForCausalLM``, SGLang's ``LlamaForCausalLMEagle3``; the probe's tests
compare logits with both on CPU)::

    h      = fc(cat(aux_1 .. aux_K))              # K target hidden states -> draft width
    x      = cat(input_layernorm(embed(token)), hidden_norm(h))   # [T, 2H] into attention
    r      = h  (or hidden_norm(h) with norm_before_residual)
    r, x   = r + attn(x), post_attention_layernorm(r + attn(x))
    r, x   = r + mlp(x),  norm(r + mlp(x))
    token' = d2t-mapped argmax(lm_head(x))        # a draft-vocabulary id + d2t[id]

At position t the draft reads the target's states at t and the token at t + 1 and
proposes the token at t + 2. Further draft layers (``num_hidden_layers`` > 1) take
the usual pre-norm residual form. Rotary embeddings come from transformers'
Llama rotary class, so every rope scaling a Llama config can name is covered.

Formats read (weights by name, after dropping a leading ``model.``):

* SpecForge / SGLang ``LlamaForCausalLMEagle3``: ``midlayer.*`` (= ``layers.0.*``),
  ``fc``, ``norm``, ``lm_head``, ``d2t`` / ``t2d``, ``embed_tokens`` optional;
* NVIDIA Model Optimizer: ``layers.0.*`` with the same names;
* speculators ``Eagle3Speculator``: ``layers.0.*``; the layer's sizes in
  ``transformer_layer_config``; ``norm_before_residual``, ``norm_before_fc``,
  ``fc_norm`` flags.

Drafts whose layer has DeepSeek MLA attention (``Eagle3DeepseekV2ForCausalLM``) load through
the same function into :mod:`eagle_capture.probe.mla_draft`; any other class is refused
(:func:`check_draft_class`) before a weight is read.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from eagle_capture.probe.draft_spec import (
    LLAMA_DRAFTS,
    MLA_DRAFTS,
    SPECULATORS_KEYS,
    DraftError,
    DraftNorm,
    DraftSpec,
    attention_input,
)
from eagle_capture.probe.mla_draft import mla_draft

__all__ = [
    "DraftError",
    "DraftSpec",
    "Eagle3Draft",
    "check_draft_class",
    "load_draft",
    "read_weights",
    "state_dict_for_format",
]


class _Layer(nn.Module):
    """One draft decoder layer; the first takes [embeds, hidden] (2H) into attention."""

    def __init__(self, spec: DraftSpec, first: bool):
        super().__init__()
        c = spec.layer_config
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads") or self.heads
        self.head_dim = c.get("head_dim") or h // self.heads
        bias = bool(c.get("attention_bias", False))
        d_in = 2 * h if first else h
        self.first = first
        self.norm_before_residual = spec.norm_before_residual
        self.q_proj = nn.Linear(d_in, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(d_in, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_in, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        mlp_bias = bool(c.get("mlp_bias", False))
        inter = c["intermediate_size"]
        self.gate_proj = nn.Linear(h, inter, bias=mlp_bias)
        self.up_proj = nn.Linear(h, inter, bias=mlp_bias)
        self.down_proj = nn.Linear(inter, h, bias=mlp_bias)
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise DraftError(
                f"draft hidden_act {act!r}: only silu (every EAGLE-3 Llama draft) is implemented"
            )
        self.input_layernorm = DraftNorm(h, eps)
        self.post_attention_layernorm = DraftNorm(h, eps)
        if first:
            self.hidden_norm = DraftNorm(h, eps)

    def attention(self, x, cos, sin):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        o = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=1.0 / math.sqrt(self.head_dim)
        )
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    def forward(self, embeds, hidden, residual, cos, sin):
        x, residual = attention_input(self, embeds, hidden, residual, self.norm_before_residual)
        x = self.attention(x, cos, sin)
        residual = x + residual
        x = self.post_attention_layernorm(residual)
        x = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return x, residual


class Eagle3Draft(nn.Module):
    """The draft's first step: :meth:`forward` gives draft-vocabulary logits,
    :meth:`to_target` maps draft ids to the target's vocabulary."""

    def __init__(self, spec: DraftSpec):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.spec = spec
        h = spec.hidden_size
        fc_in = spec.target_hidden_size * spec.num_aux
        self.input_norm = DraftNorm(fc_in, spec.rms_norm_eps) if spec.norm_before_fc else None
        self.fc_norm = (
            nn.ModuleList(
                DraftNorm(spec.target_hidden_size, spec.rms_norm_eps) for _ in range(spec.num_aux)
            )
            if spec.fc_norm
            else None
        )
        self.fc = nn.Linear(fc_in, h, bias=False)
        self.layers = nn.ModuleList(_Layer(spec, first=(i == 0)) for i in range(spec.num_layers))
        self.norm = DraftNorm(h, spec.rms_norm_eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.embed_tokens: Optional[nn.Embedding] = None
        layer = {
            k: v
            for k, v in (spec.layer_config or {}).items()
            if k not in ("architectures", "auto_map")
        }
        self.rotary = LlamaRotaryEmbedding(LlamaConfig(**layer))

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """fc over the K concatenated target states ``aux`` [..., K * target_hidden]."""
        if self.input_norm is not None:
            aux = self.input_norm(aux)
        if self.fc_norm is not None:
            chunks = aux.chunk(self.spec.num_aux, dim=-1)
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def forward(
        self, aux: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Draft-vocabulary logits [B, T, draft_vocab] from the target's states ``aux``
        [B, T, K * target_hidden] at t, the embeddings of the tokens at t + 1 and the
        positions t."""
        hidden = self.combine(aux)
        cos, sin = self.rotary(hidden, positions)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(embeds, hidden, residual, cos, sin)
        return self.lm_head(self.norm(hidden + residual))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target-vocabulary ids (``id + d2t[id]``)."""
        return draft_ids + self.d2t[draft_ids]


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder (safetensors, else PyTorch .bin)."""
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        out: dict[str, torch.Tensor] = {}
        for f in files:
            out.update(load_file(str(f)))
        return out
    files = sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pt"))
    if not files:
        raise DraftError(f"{folder}: no *.safetensors or *.bin weights")
    out = {}
    for f in files:
        out.update(torch.load(str(f), map_location="cpu", weights_only=True))
    return out


def _format_of(config: dict, names) -> str:
    if (
        any(k in config for k in SPECULATORS_KEYS)
        or (config.get("architectures") or [""])[0] == "Eagle3Speculator"
    ):
        return "speculators"
    if any(n.startswith("midlayer.") for n in names):
        return "SpecForge"
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    if any(k in eagle for k in ("next_layer_regular", "parallel_draft_step")):
        return "Model Optimizer"
    return "EAGLE-3 (vLLM's names)"


_SKIPPED = ("t2d",)  # derivable from d2t; vLLM and SGLang skip it too


def state_dict_for_format(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names -> :class:`Eagle3Draft`'s: ``model.`` dropped, ``midlayer.``
    -> ``layers.0.``; ``t2d`` dropped."""
    out = {}
    for name, tensor in weights.items():
        if name.startswith("model."):
            name = name[len("model.") :]
        if name.startswith("midlayer."):
            name = "layers.0." + name[len("midlayer.") :]
        if name.split(".")[-1] in _SKIPPED:
            continue
        if name.startswith("layers.") and ".self_attn." in name:
            name = name.replace(".self_attn.", ".")
        if name.startswith("layers.") and ".mlp." in name:
            name = name.replace(".mlp.", ".")
        out[name] = tensor
    return out


def check_draft_class(config: dict, where="the draft") -> str:
    """The draft's class (``architectures[0]``; "" when the config names none: a Llama
    layer, as the engines' EAGLE-3 loaders take it), refused unless the probe runs it."""
    archs = config.get("architectures") if isinstance(config, dict) else None
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
    if arch and arch not in LLAMA_DRAFTS + MLA_DRAFTS:
        raise DraftError(
            f"{where}: draft class {arch} is not one the probe runs (it runs "
            f"{', '.join(LLAMA_DRAFTS)}: a Llama layer; "
            f"{', '.join(MLA_DRAFTS)}: an MLA layer)"
        )
    return arch


def load_draft(
    folder,
    device="cpu",
    dtype=torch.float32,
    target_vocab: Optional[int] = None,
    target_hidden: Optional[int] = None,
    engine: str = "transformers",
):
    """The draft in ``folder`` (config.json + weights), in ``dtype`` on ``device``: an
    :class:`Eagle3Draft`, or for an MLA draft an
    :class:`~eagle_capture.probe.mla_draft.Eagle3MlaDraft` computed as the engine of the
    probe's mode ``engine`` computes it. Every weight the step needs must be there and
    every weight there must be known: a name left over or missing is an error that
    names it. An unknown draft class is refused before any weight is read."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text())
    except FileNotFoundError:
        raise DraftError(f"{folder}: no config.json (pass the draft's model folder)") from None
    except json.JSONDecodeError as exc:
        raise DraftError(f"{folder / 'config.json'}: not JSON ({exc})") from None
    arch = check_draft_class(config, str(folder))
    weights = read_weights(folder)
    fmt = _format_of(config, weights)
    state = state_dict_for_format(weights)
    fc = state.get("fc.weight")
    if fc is None:
        raise DraftError(
            f"{folder}: no fc.weight: not an EAGLE-3 draft (EAGLE-3 drafts take "
            f"K target hidden states through fc)"
        )
    spec = DraftSpec.from_config(config, fmt)
    if target_vocab is not None and "d2t" not in state and spec.draft_vocab_size != target_vocab:
        raise DraftError(
            f"{folder}: draft vocabulary {spec.draft_vocab_size} != the target's "
            f"{target_vocab} and no d2t map to translate it"
        )
    th = target_hidden or spec.target_hidden_size
    if fc.shape[1] % th:
        raise DraftError(
            f"{folder}: fc.weight is {tuple(fc.shape)}: its input is not a multiple "
            f"of the target's hidden size {th}"
        )
    spec = DraftSpec(
        **{
            **spec.__dict__,
            "num_aux": fc.shape[1] // th,
            "target_hidden_size": th,
            "vocab_size": target_vocab or spec.vocab_size,
        }
    )
    if arch in MLA_DRAFTS:
        draft = mla_draft(config, spec, engine)
    else:
        draft = Eagle3Draft(spec)
    embed = state.pop("embed_tokens.weight", None)
    if embed is not None:
        draft.embed_tokens = nn.Embedding(*embed.shape)
        draft.embed_tokens.weight.data.copy_(embed)
    if "d2t" in state:
        state["d2t"] = state["d2t"].long()
    else:
        state["d2t"] = torch.zeros(spec.draft_vocab_size, dtype=torch.long)
    own = draft.state_dict()
    own = {k: v for k, v in own.items() if not k.startswith("rotary.")}
    missing = sorted(set(own) - set(state))
    unknown = sorted(set(state) - set(own))
    if missing or unknown:
        raise DraftError(
            f"{folder} ({fmt}): "
            + "; ".join(
                part
                for part in (
                    f"missing weights {missing}" if missing else "",
                    f"weights the EAGLE-3 step does not use {unknown}" if unknown else "",
                )
                if part
            )
        )
    for name, tensor in state.items():
        if tuple(own[name].shape) != tuple(tensor.shape):
            raise DraftError(
                f"{folder} ({fmt}): {name} is {tuple(tensor.shape)}, the config "
                f"makes it {tuple(own[name].shape)}"
            )
    draft.load_state_dict(state, strict=False)
    return draft.to(device=device, dtype=dtype).eval()
