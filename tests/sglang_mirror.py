"""A faithful mirror of exactly the SGLang surface the adapters touch.

Read from the sglang wheels (FACTS.md section 2; SGLang's
srt/models/deepseek_v2.py, srt/layers/layernorm.py, srt/layers/logits_processor.py,
srt/layers/communicator.py, srt/layers/aux_hidden_states.py). Attention and MoE
are replaced by small linear maps: the adapters never touch them. Not code
copied from SGLang: the same attribute names and call structure, written anew.
"""

from typing import List, Optional

import torch
from torch import nn


class RMSNorm(nn.Module):
    """SGLang RMSNorm: ``forward(x)`` -> normed; ``forward(x, residual)`` ->
    ``fused_add_rmsnorm`` in place (residual += x; x = rmsnorm(residual) * w),
    returning the same two tensors. fp32 math."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def _norm(self, x):
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) \
            * self.weight.float()

    def forward(self, x, residual=None):
        if residual is None:
            return self._norm(x).to(x.dtype)
        residual.copy_(x + residual)
        x.copy_(self._norm(residual))
        return x, residual

    def forward_with_allreduce_fusion(self, x, residual):
        """Stands for FlashInfer's all-reduce + add + RMSNorm (world size 1 here):
        fresh outputs, not a call of ``forward``."""
        new_residual = x + residual
        return self._norm(new_residual).to(x.dtype), new_residual


class Block(nn.Module):
    """Stand-in for attention or MoE: a fixed linear map."""

    def __init__(self, hidden_size):
        super().__init__()
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x):
        return self.proj(x)


# ---------------------------------------------------------------- <= 0.5.13

class LayerCommunicator:
    """Holds its own references to the layer's norms (as SGLang's does): the
    decoder layer runs its input norm through ``prepare_attn``, never directly.
    ``allreduce_fusion=True`` stands for the FlashInfer fused all-reduce path."""

    def __init__(self, input_layernorm, post_attention_layernorm, allreduce_fusion=False):
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        self.allreduce_fusion = allreduce_fusion

    def prepare_attn(self, hidden_states, residual, forward_batch):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        elif self.allreduce_fusion:
            hidden_states, residual = self.input_layernorm.forward_with_allreduce_fusion(
                hidden_states, residual)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        return hidden_states, residual

    def prepare_attn_and_capture_last_layer_outputs(self, hidden_states, residual, forward_batch,
                                                    captured_last_layer_outputs=None):
        hidden_states, residual = self.prepare_attn(hidden_states, residual, forward_batch)
        if captured_last_layer_outputs is not None:
            gathered = residual                    # plain TP: the gather is the identity
            if gathered is residual and not getattr(captured_last_layer_outputs,
                                                    "copies_on_append", False):
                gathered = residual.clone()        # the norm updates residual in place
            captured_last_layer_outputs.append(gathered)
        return hidden_states, residual



class ClassicDecoderLayer(nn.Module):
    def __init__(self, hidden_size):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size)
        self.post_attention_layernorm = RMSNorm(hidden_size)
        self.self_attn = Block(hidden_size)
        self.mlp = Block(hidden_size)
        self.layer_communicator = LayerCommunicator(self.input_layernorm,
                                                    self.post_attention_layernorm)

    def forward(self, positions, hidden_states, forward_batch, residual):
        hidden_states, residual = self.layer_communicator.prepare_attn(
            hidden_states, residual, forward_batch)
        hidden_states = self.self_attn(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class ClassicDeepseekV2Model(nn.Module):
    def __init__(self, vocab, hidden_size, num_layers):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden_size)
        self.layers = nn.ModuleList([ClassicDecoderLayer(hidden_size) for _ in range(num_layers)])
        self.start_layer, self.end_layer = 0, num_layers
        self.norm = RMSNorm(hidden_size)
        self.layers_to_capture = []

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        hidden_states = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual = None
        aux_hidden_states = []
        for i in range(self.start_layer, self.end_layer):
            if i in self.layers_to_capture:
                aux_hidden_states.append(hidden_states + residual)
            layer = self.layers[i]
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        if len(aux_hidden_states) == 0:
            return hidden_states
        return hidden_states, aux_hidden_states


class ClassicLogitsProcessor(nn.Module):
    """The aux part of LogitsProcessor.forward in full-capture mode."""

    def forward(self, input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states=None):
        out = {"logits": lm_head(hidden_states)}
        if aux_hidden_states is not None:
            out["hidden_states"] = torch.cat(aux_hidden_states, dim=-1)
        return out


class ClassicDeepseekV2ForCausalLM(nn.Module):
    def __init__(self, vocab=50, hidden_size=32, num_layers=8):
        super().__init__()
        self.model = ClassicDeepseekV2Model(vocab, hidden_size, num_layers)
        self.lm_head = nn.Linear(hidden_size, vocab, bias=False)
        self.logits_processor = ClassicLogitsProcessor()
        self.capture_aux_hidden_states = False
        self.num_layers = num_layers

    def forward(self, input_ids, positions, forward_batch, input_embeds=None):
        hidden_states = self.model(input_ids, positions, forward_batch, input_embeds)
        aux_hidden_states = None
        if self.capture_aux_hidden_states:
            hidden_states, aux_hidden_states = hidden_states
        return self.logits_processor(input_ids, hidden_states, self.lm_head, forward_batch,
                                     aux_hidden_states)

    def set_eagle3_layers_to_capture(self, layer_ids: Optional[List[int]] = None):
        self.capture_aux_hidden_states = True
        if layer_ids is None:
            n = self.num_layers
            self.model.layers_to_capture = [2, n // 2, n - 3]
        else:
            self.model.layers_to_capture = [v + 1 for v in layer_ids]  # <= 0.5.12 rule


# ---------------------------------------------------------------- >= 0.5.18

class AuxHiddenStatePacker:
    """Preallocated [T, K*H] buffer; ``slot(like)`` returns the next [T, H]
    column view (row stride K*H) and counts it; ``append(x)`` = ``slot(x).copy_(x)``;
    ``finalize()`` returns the buffer and raises unless exactly K captures."""

    copies_on_append = True

    def __init__(self, num_captures: int, out: Optional[torch.Tensor] = None):
        self.num_captures = num_captures
        self._buffer = out
        self._count = 0
        self._width = None

    @classmethod
    def for_batch(cls, forward_batch, num_captures):
        return cls(num_captures, out=forward_batch.aux_hidden_states_buffer)

    def __len__(self):
        return self._count

    def slot(self, like: torch.Tensor) -> torch.Tensor:
        width = like.shape[-1]
        if self._width is None:
            self._width = width
            full = (*like.shape[:-1], width * self.num_captures)
            if self._buffer is None:
                self._buffer = like.new_empty(full)
            else:
                if tuple(self._buffer.shape[:-1]) != tuple(full[:-1]) or \
                        self._buffer.shape[-1] != full[-1] or self._buffer.dtype != like.dtype:
                    raise ValueError("aux buffer shape/dtype mismatch")
        if self._count >= self.num_captures:
            raise RuntimeError(f"more than {self.num_captures} captures")
        view = self._buffer[..., self._count * width:(self._count + 1) * width]
        self._count += 1
        return view

    def append(self, hidden: torch.Tensor) -> None:
        self.slot(hidden).copy_(hidden)

    def finalize(self) -> torch.Tensor:
        if self._count != self.num_captures:
            raise RuntimeError(f"captured {self._count} of {self.num_captures} aux hidden states")
        return self._buffer


class PackerDecoderLayer(ClassicDecoderLayer):
    def forward(self, positions, hidden_states, forward_batch, residual,
                captured_last_layer_outputs=None):
        hidden_states, residual = self.layer_communicator.prepare_attn_and_capture_last_layer_outputs(
            hidden_states, residual, forward_batch,
            captured_last_layer_outputs=captured_last_layer_outputs)
        hidden_states = self.self_attn(hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        hidden_states = self.mlp(hidden_states)
        return hidden_states, residual


class PackerDeepseekV2Model(ClassicDeepseekV2Model):
    def __init__(self, vocab, hidden_size, num_layers):
        super().__init__(vocab, hidden_size, num_layers)
        self.layers = nn.ModuleList([PackerDecoderLayer(hidden_size) for _ in range(num_layers)])

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, pp_proxy_tensors=None):
        hidden_states = self.embed_tokens(input_ids) if input_embeds is None else input_embeds
        residual = None
        acc = (AuxHiddenStatePacker.for_batch(forward_batch, len(self.layers_to_capture))
               if self.layers_to_capture else None)
        for i in range(self.start_layer, self.end_layer):
            hidden_states, residual = self.layers[i](
                positions, hidden_states, forward_batch, residual,
                captured_last_layer_outputs=acc if i in self.layers_to_capture else None)
        hidden_states, _ = self.norm(hidden_states, residual)
        if acc is None:
            return hidden_states
        return hidden_states, acc.finalize()


class ForwardBatch:
    def __init__(self, aux_hidden_states_buffer=None):
        self.aux_hidden_states_buffer = aux_hidden_states_buffer
