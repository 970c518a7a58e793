"""An SGLang-style DeepseekV2 layer loop over HF transformers' DeepseekV3 layers.

The structure is SGLang's ``DeepseekV2Model.forward`` (docs/engine_facts.md section 1),
the modules are HF's (``DeepseekV3Model``: embedding, MLA attention, MoE/MLP,
RMSNorm weights), so the same weights can be run both ways:

* HF's own forward with ``output_hidden_states=True`` -- what SpecForge trains
  the draft on (``hidden_states[X + 1]`` = output of layer X);
* this loop, with the *deferred residual* every SGLang layer uses: each layer
  starts with the in-place add+RMSNorm of ``(hidden_states, residual)``, so
  ``hidden_states + residual`` at the start of layer i is the residual stream
  entering layer i, and the capture is taken there -- either eagerly
  (``aux.append(h + r)``, ``torch.cat`` at the end: SGLang <= 0.5.13) or fused
  into layer i's input add+RMSNorm (this project). Layer 0 has no residual
  yet: its capture is the embedding output itself.

Used by the oracle tests (training/serving skew) and the tensor-parallel tests.
transformers is needed only for the model the loop runs over.
"""

from typing import Callable, Optional

import torch

from eagle_capture import ops
from eagle_capture.buffer import AuxCaptureBuffer
from eagle_capture.testing.reference import rmsnorm_fp32


class SGLangDeepseekLoop:
    """Runs an HF ``DeepseekV3Model`` (the ``.model`` of ``DeepseekV3ForCausalLM``)
    layer by layer the way SGLang's DeepseekV2 loop does, with a choice of capture."""

    def __init__(self, hf_model) -> None:
        self.model = hf_model
        self.layers = list(hf_model.layers)
        self.eps = float(hf_model.norm.variance_epsilon)

    def _layer_inputs(self, input_ids: torch.Tensor) -> dict:
        """The attention kwargs HF's own forward passes its layers (mask, rotary
        embeddings, positions), taken from a hooked call so that both runs see
        exactly the same ones whatever the transformers version."""
        seen = {}

        def grab(module, args, kwargs):
            seen.update(kwargs)
            raise _Stop

        handle = self.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
        try:
            self.model(input_ids=input_ids)
        except _Stop:
            pass
        finally:
            handle.remove()
        return {
            k: v
            for k, v in seen.items()
            if k in ("attention_mask", "position_embeddings", "position_ids")
        }

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        layers_to_capture,
        *,
        capture: str = "fused",
        buffer: Optional[AuxCaptureBuffer] = None,
        tp=None,
        partial: Optional[Callable[[int, torch.Tensor], torch.Tensor]] = None,
    ):
        """Returns ``(final_hidden_states [T, H], aux [T, K*H])``.

        ``input_ids`` is ``[1, T]`` (one sequence); ``capture`` is ``"eager"``
        (SGLang <= 0.5.13: append ``h + r``, ``torch.cat``) or ``"fused"``
        (into ``buffer``, allocated here when not given).

        Tensor parallelism is simulated with ``tp`` (a :class:`~eagle_capture.parallel.tp.TPCapture`
        whose buffer receives the captures) and ``partial(i, mlp_out)``, which returns
        this rank's row-parallel share of layer i's output: every layer boundary then
        all-reduces before its add+RMSNorm, as SGLang's layers do.
        """
        if tp is not None:
            capture, buffer = "fused", tp.buffer
        if capture not in ("eager", "fused"):
            raise ValueError(f"capture must be 'eager' or 'fused', got {capture!r}")
        layers_to_capture = sorted(layers_to_capture)
        attn_kwargs = self._layer_inputs(input_ids)
        hidden = self.model.embed_tokens(input_ids)[0]  # [T, H]
        num_tokens, hidden_size = hidden.shape
        if capture == "fused" and buffer is None:
            buffer = AuxCaptureBuffer(
                num_tokens, hidden_size, layers_to_capture, dtype=hidden.dtype, device=hidden.device
            )
        eager_aux = []
        residual = None
        for i, layer in enumerate(self.layers):
            w_in = layer.input_layernorm.weight
            captured = i in layers_to_capture
            if capture == "eager" and captured:  # SGLang: aux.append(h + r)
                eager_aux.append(hidden + residual if residual is not None else hidden.clone())
            if residual is None:  # layer 0: residual <- input
                if capture == "fused" and captured:
                    buffer.capture(i, hidden, None)
                residual = hidden.clone()
                # Layer 0's plain RMSNorm (no residual yet), fp32 math like the kernel.
                hidden = rmsnorm_fp32(hidden, w_in, self.eps).to(hidden.dtype)
            elif tp is not None:  # reduce, then add, then store
                tp.reduce_add_rmsnorm(i, hidden, residual, w_in, self.eps)
            elif capture == "fused" and captured:
                buffer.add_rmsnorm_capture(i, hidden, residual, w_in, self.eps)
            else:
                ops.add_rmsnorm_capture(hidden, residual, w_in, self.eps)
            attn_out = layer.self_attn(hidden_states=hidden.unsqueeze(0), **attn_kwargs)[0][0]
            hidden = attn_out.contiguous()
            ops.add_rmsnorm_capture(
                hidden, residual, layer.post_attention_layernorm.weight, self.eps
            )
            hidden = layer.mlp(hidden.unsqueeze(0))[0].contiguous()
            if partial is not None:
                hidden = partial(i, hidden).contiguous()
        if tp is not None:
            torch.distributed.all_reduce(hidden, group=tp.group)
        ops.add_rmsnorm_capture(hidden, residual, self.model.norm.weight, self.eps)
        if capture == "eager":
            aux = torch.cat(eager_aux, dim=-1)
        else:
            aux = buffer.result(num_tokens)
        return hidden, aux


class _Stop(Exception):
    pass


def hf_training_capture(
    hf_model, input_ids: torch.Tensor, draft_ids, *, convention: str = "output"
) -> torch.Tensor:
    """The training side: ``torch.cat`` of HF ``output_hidden_states`` for the
    draft's ids, as SpecForge builds the draft's input (``[T, K*H]``)."""
    with torch.no_grad():
        states = hf_model(input_ids=input_ids, output_hidden_states=True).hidden_states
    shift = 1 if convention == "output" else 0
    return torch.cat([states[i + shift][0] for i in sorted(draft_ids)], dim=-1)
