"""What every EAGLE-3 draft the probe runs shares, Llama or MLA attention: the error a draft
folder raises, the draft classes the probe runs, what the step needs from a config
(:class:`DraftSpec`), the draft's RMSNorm and a draft layer's attention input.

:mod:`eagle_capture.probe.draft` builds the Llama step and loads every draft;
:mod:`eagle_capture.probe.mla_draft` builds the MLA step. Both stand on this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn


class DraftError(ValueError):
    """A draft folder the probe cannot read: the message names what is wrong."""


# The draft classes the probe runs: a Llama layer (SGLang's LlamaForCausalLMEagle3, vLLM's
# Eagle3LlamaForCausalLM under both names, speculators' Eagle3Speculator), or an MLA layer
# (SGLang's and vLLM's Eagle3DeepseekV2ForCausalLM: probe/mla_draft.py).
LLAMA_DRAFTS = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
MLA_DRAFTS = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
SPECULATORS_KEYS = ("speculators_model_type", "speculators_config", "transformer_layer_config")


@dataclass(frozen=True)
class DraftSpec:
    """What the step needs from a draft's config.json."""

    format: str  # "SpecForge", "speculators", "Model Optimizer", "EAGLE-3 (vLLM names)"
    hidden_size: int
    target_hidden_size: int
    num_aux: int  # K: target states concatenated into fc
    num_layers: int
    vocab_size: int  # the target's vocabulary (d2t maps into it)
    draft_vocab_size: int
    rms_norm_eps: float
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    fc_norm: bool = False
    layer_config: Optional[dict] = None  # a Llama config dict for the decoder layer(s)

    @classmethod
    def from_config(cls, config: dict, fmt: str, num_aux: Optional[int] = None) -> "DraftSpec":
        speculators = fmt == "speculators"
        layer = dict(config.get("transformer_layer_config") or {}) if speculators else dict(config)
        if not layer:
            raise DraftError(
                "a speculators config without transformer_layer_config: the "
                "draft layer's sizes are not written anywhere"
            )
        for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
            if not isinstance(layer.get(key), int):
                raise DraftError(
                    f"the draft config has no integer {key} "
                    f"({'transformer_layer_config' if speculators else 'top level'})"
                )
        hidden = layer["hidden_size"]
        vocab = layer.get("vocab_size", config.get("vocab_size"))
        draft_vocab = config.get("draft_vocab_size") or vocab
        target_hidden = config.get("target_hidden_size") or hidden
        eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
        ids = eagle.get("eagle_aux_hidden_state_layer_ids") or config.get(
            "eagle_aux_hidden_state_layer_ids"
        )
        k = num_aux or config.get("num_aux_hidden_states") or (len(ids) if ids else 3)

        def flag(name, default=False):
            return bool(eagle.get(name, config.get(name, default)))

        return cls(
            format=fmt,
            hidden_size=hidden,
            target_hidden_size=target_hidden,
            num_aux=k,
            num_layers=int(layer.get("num_hidden_layers") or 1),
            vocab_size=int(vocab),
            draft_vocab_size=int(draft_vocab),
            rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)),
            # vLLM reads a speculators config without the key as True (speculators
            # itself always writes it); the other formats have no such flag: False.
            norm_before_residual=flag("norm_before_residual", speculators),
            norm_before_fc=flag("norm_before_fc"),
            fc_norm=flag("fc_norm"),
            layer_config=layer,
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Llama's RMSNorm: statistics in (at least) fp32, the weight applied in the input's dtype.
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class DraftNorm(nn.Module):
    """The draft's RMSNorm (Llama's: statistics in fp32, the weight in the input's dtype)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def attention_input(layer: nn.Module, embeds, hidden, residual, norm_before_residual: bool):
    """A draft layer's attention input and residual (every EAGLE-3 draft layer, Llama or
    MLA attention): the first layer concatenates the normed embeddings and the normed fc
    output, whose residual is the fc output (or its norm with ``norm_before_residual``);
    a later layer adds its residual and norms the sum."""
    if not layer.first:
        residual = hidden + residual
        return layer.input_layernorm(residual), residual
    e = layer.input_layernorm(embeds)
    if norm_before_residual:
        hidden = layer.hidden_norm(hidden)
        residual = hidden
    else:
        residual = hidden
        hidden = layer.hidden_norm(hidden)
    return torch.cat([e, hidden], dim=-1), residual
