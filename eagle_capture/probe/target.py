"""The target's hidden state at every capture layer, and its greedy next tokens.

Capture layer c is the input of decoder layer c (the residual stream there:
SGLang's ``hidden_states + residual``, vLLM's aux state, HF ``hidden_states[c]``);
c = 0 is the embedding output and c = N the last layer's output before the final
norm (vLLM's id N, gpt_oss's final boundary). They are read with hooks on the
decoder layers themselves, not from ``output_hidden_states``, whose last entry is
the normed output in some transformers versions.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from eagle_capture.layer_ids.validate import check_capture_layers

__all__ = ["decoder_layers", "target_states"]


def decoder_layers(model: nn.Module, num_layers: int) -> nn.ModuleList:
    """The model's decoder layers: the one ModuleList of ``num_layers`` modules
    (``model.model.layers`` for every Llama-like family; Kimi-K2.5's language model)."""
    found = [
        m
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList)
        and len(m) == num_layers
        and name.split(".")[-1] in ("layers", "h", "blocks")
    ]
    if len(found) != 1:
        raise ValueError(
            f"expected one list of {num_layers} decoder layers in "
            f"{type(model).__name__}, found {len(found)}"
        )
    return found[0]


def _hidden(args, kwargs) -> torch.Tensor:
    x = kwargs.get("hidden_states", args[0] if args else None)
    if not isinstance(x, torch.Tensor):
        raise TypeError("a decoder layer was called without a hidden_states tensor")
    return x


@torch.no_grad()
def target_states(
    model: nn.Module, layers: nn.ModuleList, input_ids: torch.Tensor, keep: Iterable[int]
) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """Run ``model`` on ``input_ids`` [B, T]: the states at capture layers ``keep``
    ({c: [B, T, H]}) and the greedy next token after each position [B, T]."""
    n = len(layers)
    keep = check_capture_layers(sorted(set(keep)), num_layers=n)
    states: dict[int, torch.Tensor] = {}
    hooks = []

    def before(c):
        def hook(module, args, kwargs):
            states[c] = _hidden(args, kwargs).detach().clone()

        return hook

    def after(module, args, kwargs, output):
        out = output[0] if isinstance(output, (tuple, list)) else output
        states[n] = out.detach().clone()

    try:
        for c in keep:
            if c < n:
                hooks.append(layers[c].register_forward_pre_hook(before(c), with_kwargs=True))
        if n in keep:
            hooks.append(layers[n - 1].register_forward_hook(after, with_kwargs=True))
        logits = model(input_ids=input_ids, use_cache=False).logits
    finally:
        for h in hooks:
            h.remove()
    missing = [c for c in keep if c not in states]
    if missing:
        raise RuntimeError(f"the target's forward did not pass capture layers {missing}")
    return states, logits.argmax(-1)
