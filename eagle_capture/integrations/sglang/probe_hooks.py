"""The probe's capture inside SGLang's engine (``eagle-capture probe --engine sglang``).

SGLang's ``forward_hooks`` server argument (``ServerArgs.forward_hooks``; read in
0.5.9, 0.5.13, 0.5.20, 0.5.22 and 0.5.23, ``srt/model_executor/hook_manager.py``)
takes a list of specs ``{"name", "target_modules": [fnmatch patterns over
model.named_modules()], "hook_factory": "pkg.module:fn", "config": {...}}``; every
TP rank's model runner imports the factory, calls it with ``config`` and registers
what it returns with ``register_forward_hook`` on each matching module (after the
model is loaded; from 0.5.20 after CUDA-graph capture). :func:`specs` writes the
probe's; :func:`hook` is the factory. No SGLang code is changed and no draft is
served: the engine runs the target as it serves it.

Where the state is read (capture layer c = the input of decoder layer c, as
SGLang's own EAGLE-3 capture defines it): a forward hook on layer c's
``input_layernorm``. Every line read calls it as ``norm(hidden_states, residual)``
with the previous layer's output still to be added -- the decoder loop <= 0.5.20,
``attn_boundary.prepare`` (``layer_boundary/residual/add_norm.py``) from 0.5.22, where
a decoder layer returns a deferred output object instead of tensors -- and the norm
returns ``(normed, residual)`` with ``residual = hidden_states + residual``: the full,
reduced stream that SGLang's own capture stores (the boundary completes any owed
all-reduce before the norm). Layer 0's norm is called with the stream alone
(``norm(hidden_states)``): its input is the state. Capture layer N (the last
layer's output) is read the same way at the final norm (``model.norm``). The
FlashInfer all-reduce + RMSNorm fusion calls the norm's fused method instead of the
module: the hook would not run there, so the probe turns the fusion off (and counts
rows: a layer whose hook did not run has none, which the probe refuses).

Per forward each rank writes one record to the probe's side channel, a directory
(``config["dir"]``): the forward's input ids, per capture layer its rows, width and
per-row digest (:func:`~eagle_capture.integrations.vllm.probe_capture.digest`), and
from TP rank 0 also the states and the embedding output (the draft's input when it
has no ``embed_tokens`` of its own). A record is written whole (a temporary file
renamed), named ``<rank>.<sequence>.pt``.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from eagle_capture.integrations.vllm.probe_capture import digest

__all__ = ["FACTORY", "hook", "specs"]

FACTORY = "eagle_capture.integrations.sglang.probe_hooks:hook"

# One capture per side-channel directory in this process (the factory is called once
# per spec; the specs of one probe share it).
_CAPTURES: dict = {}


def _patterns(name: str) -> list[str]:
    """``name`` under the text model ``model`` at the top (Llama-like, DeepseekV2) or
    under a wrapper (Kimi-K2.5's ``language_model.model``)."""
    return [f"model.{name}", f"*.model.{name}"]


def specs(directory: str, layers, num_layers: int) -> list[dict]:
    """The ``forward_hooks`` specs that capture ``layers`` (capture layers in
    [0, num_layers]) into ``directory``."""
    base = {"hook_factory": FACTORY}

    def spec(name, targets, **config):
        return dict(
            base,
            name=name,
            target_modules=targets,
            config=dict(config, dir=str(directory), layers=sorted(layers), num_layers=num_layers),
        )

    out = [spec("eagle_probe_embed", _patterns("embed_tokens"), role="embed")]
    out += [
        spec(
            f"eagle_probe_layer_{c}",
            _patterns(f"layers.{c}.input_layernorm"),
            role="state",
            layer=c,
        )
        for c in sorted(layers)
        if c < num_layers
    ]
    out.append(spec("eagle_probe_final", _patterns("norm"), role="final"))
    return out


def _tp() -> tuple[int, int]:
    """This process's (TP rank, TP size): SGLang's TP group (parallel_state in every line
    read; 0.5.23's package no longer re-exports the rank helpers)."""
    from sglang.srt.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    return group.rank_in_group, group.world_size


def _device() -> str:
    """This rank's device (SGLang sets the current CUDA device before loading)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return f"cuda:{torch.cuda.current_device()} ({torch.cuda.get_device_name()})"
    return "cpu"


class _Capture:
    """One rank's capture for one probe: the current forward's states, then its record."""

    def __init__(self, config: dict) -> None:
        self.dir = config["dir"]
        self.layers = list(config["layers"])
        self.num_layers = int(config["num_layers"])
        self.seq = 0
        self.forward: Optional[dict] = None
        self.modules: dict = {}  # role -> the module it fired on (one per role)
        self.registered: set = set()

    def hello(self, config: dict) -> None:
        """Say that this rank registered ``config``'s spec (the probe waits for every
        rank's before it sends a prompt)."""
        rank, tp = _tp()
        self.registered.add(
            config["role"] if config["role"] != "state" else f"layer {config['layer']}"
        )
        path = os.path.join(self.dir, f"hello.{rank}.json")
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(
                {
                    "rank": rank,
                    "tp": tp,
                    "pid": os.getpid(),
                    "device": _device(),
                    "specs": sorted(self.registered),
                },
                f,
            )
        os.replace(tmp, path)

    def _once(self, role, module) -> None:
        # A pattern that matched two modules (a second model inside the first) would mix
        # their states: refused, named, in the record.
        seen = self.modules.setdefault(role, id(module))
        if seen != id(module):
            self._current()["errors"].append(
                f"the hook for {role} ran on two modules ({type(module).__name__})"
            )

    def _current(self) -> dict:
        if self.forward is None:
            self.forward = {"input_ids": None, "embeds": None, "states": {}, "errors": []}
        return self.forward

    def on_embed(self, module, args, output) -> None:
        self._once("embed", module)
        self.forward = None  # a new forward starts at the embedding
        fwd = self._current()
        ids = args[0] if args else None
        if isinstance(ids, torch.Tensor):
            fwd["input_ids"] = ids.detach().to("cpu", torch.int64).reshape(-1)
        if isinstance(output, torch.Tensor):
            fwd["embeds"] = output.detach().clone()

    def _state(self, c: int, args, output) -> None:
        # (normed, residual) after the add: the residual is the stream at c; a call
        # without a residual normalises the stream itself, its input.
        if (
            isinstance(output, (tuple, list))
            and len(output) >= 2
            and isinstance(output[1], torch.Tensor)
        ):
            state = output[1]
        else:
            state = args[0]
        self._current()["states"].setdefault(c, []).append(state.detach().clone())

    def on_state(self, c: int, module, args, output) -> None:
        self._once(f"layer {c}", module)
        self._state(c, args, output)

    def on_final(self, module, args, output) -> None:
        self._once("final", module)
        if self.num_layers in self.layers:
            self._state(self.num_layers, args, output)
        self._write(self._current())
        self.forward = None

    def _write(self, fwd: dict) -> None:
        rank, tp = _tp()
        states = {c: torch.cat(fwd["states"][c]) for c in self.layers if fwd["states"].get(c)}
        record = {
            "rank": rank,
            "tp": tp,
            "input_ids": fwd["input_ids"],
            "errors": fwd["errors"],
            "rows": {c: int(states[c].shape[0]) if c in states else 0 for c in self.layers},
            "width": {c: int(states[c].shape[-1]) for c in states},
            "digest": {c: digest(s) for c, s in states.items()},
            "device": str(next(iter(states.values())).device) if states else "?",
        }
        if rank == 0:
            record["states"] = {c: s.cpu() for c, s in states.items()}
            record["embeds"] = fwd["embeds"].cpu() if fwd["embeds"] is not None else None
        self.seq += 1
        path = os.path.join(self.dir, f"{rank}.{self.seq:08d}.pt")
        tmp = f"{path}.tmp"
        torch.save(record, tmp)
        os.replace(tmp, path)


def hook(config: dict):
    """SGLang's hook factory: the forward hook for one spec of :func:`specs`."""
    cap = _CAPTURES.get(config["dir"])
    if cap is None:
        cap = _CAPTURES[config["dir"]] = _Capture(config)
    cap.hello(config)
    role = config["role"]
    if role == "embed":
        return cap.on_embed
    if role == "final":
        return cap.on_final
    c = int(config["layer"])
    return lambda module, args, output: cap.on_state(c, module, args, output)
