"""The target's hidden state at every capture layer, and its greedy next tokens.

Capture layer c is the input of decoder layer c (the residual stream there:
SGLang's ``hidden_states + residual``, vLLM's aux state, HF ``hidden_states[c]``);
c = 0 is the embedding output and c = N the last layer's output before the final
norm (vLLM's id N, gpt_oss's final boundary). They are read with hooks on the
decoder layers themselves, not from ``output_hidden_states``, whose last entry is
the normed output in some transformers versions.

:class:`TransformersTarget` is the probe's runner for the target in transformers on one
device (:mod:`eagle_capture.probe.runners`).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterable

import torch
from torch import nn

from eagle_capture.layer_ids.validate import check_capture_layers
from eagle_capture.probe.runners import (
    DTYPES,
    EngineError,
    Log,
    Setup,
    TargetRunner,
    size,
    states_bytes,
)

__all__ = ["TransformersTarget", "decoder_layers", "target_states"]


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


def _weights_bytes(folder: Path, dtype: torch.dtype) -> int:
    """The target's weights in ``dtype``: counted from the safetensors headers
    (no tensor read), else the files' size."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return sum(f.stat().st_size for f in folder.glob("*.bin"))
    from safetensors import safe_open

    numel = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                numel += math.prod(h.get_slice(k).get_shape())
    return numel * torch.empty((), dtype=dtype).element_size()


def _available(device: torch.device) -> int:
    """Memory free for the target: the device's free memory, or the host's available
    memory (Linux's MemAvailable counts reclaimable page cache; free pages alone do not)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _load_target(folder: Path, device, dtype):
    import transformers

    kwargs = (
        {"dtype": dtype}
        if int(transformers.__version__.split(".")[0]) >= 5
        else {"torch_dtype": dtype}
    )
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise EngineError(
            f"--target {folder}: transformers cannot load it as a causal LM "
            f"({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from None
    return model.to(device).eval()


class TransformersTarget(TargetRunner):
    """The target in Hugging Face transformers on one device, read by hooks on its
    decoder layers (:func:`target_states`): :meth:`run` gives, for one prompt, the
    states at the capture layers ``keep`` ({c: [1, T, H]}), the greedy next token at
    each position [1, T] and the tokens' embeddings [1, T, H], on ``device``."""

    engine_name = "transformers"
    words = "transformers"
    # No engine's code runs: the report shows every engine's lines.
    answers_for = ("sglang", "vllm")

    def __init__(
        self,
        folder: Path,
        num_layers: int,
        keep: Iterable[int],
        device="cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.tp = 1
        self.keep = sorted(set(keep))
        self.device = torch.device(device)
        self.model = _load_target(Path(folder), self.device, dtype)
        self.layers = decoder_layers(self.model, num_layers)
        self.embed = self.model.get_input_embeddings()

    @classmethod
    def plan(cls, setup: Setup, log: Log) -> None:
        dev, torch_dtype = setup.device, DTYPES[setup.dtype]
        weights = _weights_bytes(setup.folder, torch_dtype)
        need = int(1.2 * weights) + states_bytes(
            setup.keep, setup.max_tokens, setup.target.hidden_size, torch_dtype.itemsize
        )
        free = _available(dev)
        log(
            f"probe: {setup.plan}; needs ~{size(need)} on {dev} ({size(weights)} of weights "
            f"in {setup.dtype}), {size(free)} free"
        )
        if need > free:
            raise EngineError(
                f"the target needs ~{size(need)} in {setup.dtype} on {dev}, "
                f"{size(free)} are free: a target this size does not fit one "
                f"device (the probe runs the whole target on one); use a machine with "
                f"more memory, --dtype bf16, or --engine vllm --tp N to run it in "
                f"vLLM's engine over N GPUs"
            )

    @classmethod
    def start(cls, setup: Setup, log: Log) -> "TransformersTarget":
        return cls(
            setup.folder,
            setup.target.num_layers,
            setup.keep,
            setup.device,
            DTYPES[setup.dtype],
        )

    def reset_counts(self) -> None:
        """Nothing is counted: one device, no engine to compare with."""

    @torch.no_grad()
    def run(self, tokens: list[int]):
        ids = torch.tensor([tokens], device=self.device)
        states, greedy = target_states(self.model, self.layers, ids, self.keep)
        return states, greedy, self.embed(ids)

    def measured(self, setup: Setup) -> dict:
        return {"engine": "transformers", "device": str(self.device), "dtype": setup.dtype}

    def where(self) -> str:
        return str(self.device)

    def close(self) -> None:
        self.model = self.layers = self.embed = None
