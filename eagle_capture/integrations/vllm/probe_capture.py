"""The probe's capture inside vLLM's engine (``eagle-capture probe --engine vllm``).

:class:`ProbeCapture` is a vLLM worker extension: ``LLM(worker_extension_cls=
"eagle_capture.integrations.vllm.probe_capture.ProbeCapture")`` mixes it into vLLM's
worker class in every worker process (``WorkerWrapperBase.init_worker``, vllm 0.32.0),
and ``LLM.collective_rpc("eagle_probe_...")`` calls its methods on every rank at once.
No vLLM code is changed and no EAGLE-3 draft is served: the engine runs the target as
it serves it (its TP size, dtype, quantisation) and the probe reads, per prompt:

* capture layer c (the input of decoder layer c, c = N the input of the final norm):
  ``hidden_states + residual`` as vLLM's own EAGLE-3 capture computes it, taken by a
  forward pre-hook on decoder layer c (on the final norm for c = N) -- after vLLM's
  loop has all-gathered token-scattered rows (DeepseekV2's sequence-parallel MoE) and
  after the all-reduce of the previous layer's attention and MLP; c = 0 is layer 0's
  input (the embedding output, no residual yet);
* the target's greedy next token at every position: the final norm's output through the
  model's own ``compute_logits`` (vLLM gathers the vocabulary shards);
* the embeddings of the prompt's tokens (the model's ``embed_input_ids``), which a draft
  without its own ``embed_tokens`` shares with the target.

Every rank captures and answers. Rank 0 sends the states; every rank sends a digest of
its own (a fixed random projection per row), which the probe compares across ranks: a
capture of per-rank partial sums or of a TP shard differs between ranks or has the
wrong width, and is refused rather than scored. The hooks need an eager model (the
probe starts vLLM with ``enforce_eager``: torch.compile would trace the layer loop
without them).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

__all__ = ["DIGEST_DIM", "ProbeCapture", "digest", "pack", "unpack"]

QUALNAME = "eagle_capture.integrations.vllm.probe_capture.ProbeCapture"
DIGEST_DIM = 8


def digest(x: torch.Tensor) -> torch.Tensor:
    """A per-row fingerprint of ``x`` [T, H]: its projection on DIGEST_DIM fixed random
    directions, in float64 on the CPU (the same directions on every rank and in the probe)."""
    g = torch.Generator().manual_seed(1234)
    directions = torch.randn(x.shape[-1], DIGEST_DIM, generator=g, dtype=torch.float64)
    return x.detach().to("cpu", torch.float64) @ directions


def pack(t: torch.Tensor) -> dict:
    """A tensor as plain data for ``collective_rpc``'s answer: vLLM's engine-core channel
    (msgpack) sends an untyped result's tensors as bare lists; bytes pass as they are."""
    t = t.detach().contiguous().cpu()
    return {
        "dtype": str(t.dtype).removeprefix("torch."),
        "shape": list(t.shape),
        "data": t.view(torch.uint8).numpy().tobytes() if t.numel() else b"",
    }


def unpack(d: dict) -> torch.Tensor:
    dtype = getattr(torch, d["dtype"])
    flat = (
        torch.frombuffer(bytearray(d["data"]), dtype=torch.uint8)
        if d["data"]
        else torch.empty(0, dtype=torch.uint8)
    )
    return flat.view(dtype).reshape(d["shape"])


def _stream(args, kwargs) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(hidden_states, residual) of a decoder layer's or the final norm's call: the
    first two floating-point tensors among the first three positional arguments (vLLM's
    loops call ``layer(positions, hidden_states, residual, ...)``, GPT-OSS's ``layer(x,
    positions, residual)``, the norm ``norm(hidden_states, residual)``), else by name."""
    floats = [a for a in args[:3] if isinstance(a, torch.Tensor) and a.is_floating_point()]
    hidden = kwargs.get("hidden_states", kwargs.get("x", floats[0] if floats else None))
    residual = kwargs.get("residual", floats[1] if len(floats) > 1 else None)
    if not isinstance(hidden, torch.Tensor):
        raise RuntimeError(
            "eagle_capture probe: a decoder layer was called without a hidden states tensor"
        )
    return hidden, residual


def _decoder_stack(model: nn.Module, num_layers: int) -> tuple[nn.ModuleList, nn.Module]:
    """The model's decoder layers (the one ModuleList of ``num_layers`` named layers) and
    its final norm (``norm`` beside them): Llama-like families, DeepseekV2, Kimi's
    language model."""
    found = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList)
        and len(m) == num_layers
        and name.split(".")[-1] in ("layers", "h", "blocks")
    ]
    if len(found) != 1:
        raise RuntimeError(
            f"eagle_capture probe: expected one list of {num_layers} decoder "
            f"layers in {type(model).__name__}, found {len(found)}"
        )
    name, layers = found[0]
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    norm = getattr(parent, "norm", None)
    if not isinstance(norm, nn.Module):
        raise RuntimeError(
            f"eagle_capture probe: no final norm beside {name} in {type(model).__name__}"
        )
    return layers, norm


class ProbeCapture:
    """vLLM worker extension: the probe's hooks (see the module's docstring). The method
    names start with ``eagle_probe_`` (vLLM refuses an extension whose names clash with
    the worker's)."""

    def _eagle_probe_model(self) -> nn.Module:
        model = self.model_runner.get_model()
        return model.unwrap() if hasattr(model, "unwrap") else model

    def eagle_probe_install(self, layers: list, num_layers: int) -> dict:
        """Hook capture layers ``layers`` (ascending, in [0, num_layers]); what this rank is."""
        self.eagle_probe_remove()
        model = self._eagle_probe_model()
        stack, norm = _decoder_stack(model, num_layers)
        store: dict = {"states": {}, "final": [], "layers": list(layers)}
        hooks = []

        def before(c):
            def hook(module, args, kwargs):
                hidden, residual = _stream(args, kwargs)
                state = hidden if residual is None else hidden + residual
                store["states"].setdefault(c, []).append(state.detach().clone())

            return hook

        def final(module, args, kwargs, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            store["final"].append(out.detach().clone())

        for c in layers:
            target = stack[c] if c < num_layers else norm
            hooks.append(target.register_forward_pre_hook(before(c), with_kwargs=True))
        hooks.append(norm.register_forward_hook(final, with_kwargs=True))
        self._eagle_probe = (store, hooks)
        self._eagle_probe_hidden = norm.weight.shape[-1] if hasattr(norm, "weight") else 0
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return {
            "rank": get_tensor_model_parallel_rank(),
            "tp": get_tensor_model_parallel_world_size(),
            "device": str(next(model.parameters()).device),
        }

    def eagle_probe_take(self, token_ids: list) -> dict:
        """This rank's captures of the prompt ``token_ids`` (the rows of the forwards since
        the last call, in order: the prompt's), then cleared:
        per layer its width and per-row digest, the greedy tokens; from TP rank 0 also
        the states themselves (on the CPU) and the prompt's embeddings."""
        from vllm.distributed import get_tensor_model_parallel_rank

        send_states = get_tensor_model_parallel_rank() == 0
        store, _ = self._eagle_probe
        n = len(token_ids)
        # Every row since the last call: the prompt's forwards only (one, or its chunks),
        # so exactly n rows per layer; anything else is reported (rows), never trimmed.
        states = {
            c: torch.cat(store["states"][c])
            if store["states"].get(c)
            else torch.empty(0, self._eagle_probe_hidden)
            for c in store["layers"]
        }
        final = torch.cat(store["final"]) if store["final"] else None
        store["states"], store["final"] = {}, []
        rows = {c: s.shape[0] for c, s in states.items()}
        out = {
            "rows": rows,
            "width": {c: s.shape[-1] for c, s in states.items()},
            "digest": {c: pack(digest(s)) for c, s in states.items()},
        }
        if final is None or final.shape[0] != n or any(r != n for r in rows.values()):
            out["greedy"] = None
            return out
        model = self._eagle_probe_model()
        # Both calls are collectives over the TP group (the vocabulary is sharded): every
        # rank makes them, in the same order.
        with torch.inference_mode():
            # Chunks bound the [rows, vocabulary] logits (vLLM all-gathers the shards).
            greedy = [model.compute_logits(final[i : i + 256]).argmax(-1) for i in range(0, n, 256)]
            embeds = model.embed_input_ids(torch.as_tensor(token_ids, device=final.device))
        out["greedy"] = pack(torch.cat(greedy))
        if send_states:
            out["embeds"] = pack(embeds)
            out["states"] = {c: pack(s) for c, s in states.items()}
        return out

    def eagle_probe_remove(self) -> None:
        probe = getattr(self, "_eagle_probe", None)
        if probe is not None:
            for h in probe[1]:
                h.remove()
        self._eagle_probe = None
