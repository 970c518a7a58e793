"""The first speculative step of an EAGLE-3 draft whose layer has DeepSeek MLA attention
(``Eagle3DeepseekV2ForCausalLM``: TorchSpec's and Model Optimizer's Kimi-K2.x drafts),
as SGLang (``models/kimi_k25_eagle3.py``, 0.5.13+) and vLLM
(``model_executor/models/deepseek_eagle3.py``, 0.32 - 0.34) compute it::

    h      = fc(cat(aux_1 .. aux_K))        # (per-state RMSNorms first with fc_norm)
    x      = cat(input_layernorm(embed(token)), hidden_norm(h))      # [T, 2H]
    r      = h  (vLLM with norm_before_residual: hidden_norm(h))
    a      = MLA(x)                         # the q_a / kv_a projections take the 2H input
    r, x   = r + a, post_attention_layernorm(r + a)
    r, x   = r + mlp(x), norm(r + mlp(x))
    token' = d2t-mapped argmax(lm_head(x))

MLA (DeepSeek-V2): ``q = q_b_proj(q_a_layernorm(q_a_proj(x)))`` (``q_proj(x)`` without
``q_lora_rank``), split per head into ``qk_nope_head_dim`` + ``qk_rope_head_dim``;
``kv_a_proj_with_mqa(x)`` gives the ``kv_lora_rank`` latent and one shared rope key;
``kv_b_proj(kv_a_layernorm(latent))`` gives each head's nope key and value. Rotary
embeddings on the rope parts only, DeepSeek's interleaved pairs (SGLang: neox halves
when the config says ``rope_interleave: false``), any rope scaling read as DeepSeek's
YaRN (both engines rename every scaling type to ``deepseek_yarn``) with its magnitude
``mscale`` on cos / sin and ``yarn_get_mscale(factor, mscale_all_dim)**2`` on the
softmax scale. The engines run the attention absorbed into the latent space (SGLang) or
through their MLA backends (vLLM); here it is the same product unabsorbed, equal up to
fp32 rounding (``tests/test_mla_draft.py`` compares with both engines' own classes).

Where the two engines read a config differently (:func:`engine_readings`), the step is
computed as the engine the probe measures for; in transformers mode SGLang's (the only
engine whose Kimi-K2.x target runs this class on the lines read), vLLM's where SGLang
cannot load the draft (more than one layer), and the difference is a note.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from eagle_capture.probe.draft_spec import DraftError, DraftNorm, DraftSpec, attention_input

__all__ = ["MLA_CLASSES", "MlaReading", "Eagle3MlaDraft", "engine_readings", "mla_draft"]

# vLLM registers both names for its one class (model_executor/models/registry.py).
MLA_CLASSES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
# transformers' DeepseekV3Config defaults, which both engines load these configs with
# (SGLang aliases model_type kimi_k2 to it, vLLM's config registry maps it).
_DEFAULTS = {
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
}


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _correction_range(beta_fast, beta_slow, dim: int, base: float, original: int):
    def at(rotations):
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    return max(math.floor(at(beta_fast)), 0), min(math.ceil(at(beta_slow)), dim - 1)


@dataclass(frozen=True)
class MlaReading:
    """How one engine computes the step for a config (the fields where they can differ)."""

    engine: str  # "SGLang" or "vLLM"
    norm_before_residual: bool
    fc_norm: bool
    neox: bool  # rope in halves (else DeepSeek's interleaved pairs)
    rope: Optional[dict]  # DeepSeek YaRN parameters, None: plain rope
    rope_mscale: float  # on cos and sin
    softmax_scale: float
    problem: str = ""  # why this engine cannot run the draft ("": it can)

    def differences(self, other: "MlaReading") -> list[str]:
        out = []
        for name in (
            "norm_before_residual",
            "fc_norm",
            "neox",
            "rope",
            "rope_mscale",
            "softmax_scale",
        ):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name}: {self.engine} {a}, {other.engine} {b}")
        return out


def _rope_parameters(config: dict) -> tuple[float, Optional[dict]]:
    """(rope_theta, the scaling dict or None) as transformers standardises the config:
    ``rope_scaling`` (legacy) or ``rope_parameters``, ``type`` read as ``rope_type``."""
    params = (
        config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else None
    )
    scaling = config.get("rope_scaling") if isinstance(config.get("rope_scaling"), dict) else params
    theta = (
        config.get("rope_theta")
        or (params or {}).get("rope_theta")
        or (scaling or {}).get("rope_theta")
        or _DEFAULTS["rope_theta"]
    )
    if scaling is None:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type"))
    return float(theta), (None if kind in (None, "default") else dict(scaling))


def engine_readings(config: dict) -> dict[str, MlaReading]:
    """{"sglang": ..., "vllm": ...}: each engine's reading of an MLA draft config.

    SGLang 0.5.13 (``kimi_k25_eagle3.py`` Eagle3MLADecoderLayer / Eagle3MLAModel,
    ``deepseek_v2.py`` DeepseekV2AttentionMLA, ``rotary_embedding/rope_variant.py``
    DeepseekScalingRotaryEmbedding): residual = fc output (no norm_before_residual),
    ``fc_norm`` or ``use_aux_norm``, neox only with ``rope_interleave: false``, rope
    mscale times ``attn_factor``, softmax mscale unless ``apply_yarn_scaling: false``,
    one layer only. vLLM 0.32 (``deepseek_eagle3.py``, ``deepseek_v2.py``
    DeepseekV2MLAAttention, ``rotary_embedding/deepseek_scaling_rope.py``):
    ``norm_before_residual``, ``fc_norm``, always interleaved, no ``attn_factor``, no
    softmax mscale when ``attention_factor`` is 1.0 (its ``deepseek_llama_scaling``)."""
    theta, scaling = _rope_parameters(config)
    nope, rope_dim = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    base_scale = (nope + rope_dim) ** -0.5
    out = {}
    for engine in ("sglang", "vllm"):
        rope, rope_mscale, scale = None, 1.0, base_scale
        if scaling is not None:
            if "factor" not in scaling or (
                engine == "vllm" and "original_max_position_embeddings" not in scaling
            ):
                raise DraftError(
                    f"rope scaling {scaling.get('rope_type', scaling.get('type'))!r} without "
                    f"factor / original_max_position_embeddings: the engines read every MLA "
                    f"rope scaling as DeepSeek's YaRN, which needs both"
                )
            factor = float(scaling["factor"])
            rope = {
                "theta": theta,
                "factor": factor,
                "original": int(
                    scaling.get(
                        "original_max_position_embeddings",
                        config.get("max_position_embeddings", _DEFAULTS["max_position_embeddings"]),
                    )
                ),
                "beta_fast": scaling.get("beta_fast", 32),
                "beta_slow": scaling.get("beta_slow", 1),
            }
            rope_mscale = float(
                yarn_get_mscale(factor, float(scaling.get("mscale", 1)))
                / yarn_get_mscale(factor, float(scaling.get("mscale_all_dim", 0)))
            )
            all_dim = yarn_get_mscale(factor, float(scaling.get("mscale_all_dim", False)))
            if engine == "sglang":
                rope["extrapolation"] = scaling.get("extrapolation_factor", 1)
                rope_mscale = float(rope_mscale * scaling.get("attn_factor", 1))
                if scaling.get("apply_yarn_scaling", True):
                    scale = base_scale * all_dim * all_dim
            elif scaling.get("attention_factor") != 1.0:
                scale = base_scale * all_dim * all_dim
            if engine == "vllm":
                rope["extrapolation"] = 1
        layers = int(config.get("num_hidden_layers") or 1)
        if engine == "sglang":
            problem = (
                ""
                if layers == 1
                else f"SGLang's Eagle3DeepseekV2ForCausalLM takes one layer (it raises "
                f"'EAGLE3 currently only supports 1 layer'); this draft has {layers}"
            )
            if not config.get("q_lora_rank"):
                problem = (
                    "SGLang's Eagle3DeepseekV2ForCausalLM refuses a draft without "
                    "q_lora_rank (it raises 'Eagle3 MLA layer requires q_lora_rank in "
                    "the draft config')"
                )
            reading = MlaReading(
                "SGLang",
                False,
                bool(config.get("fc_norm") or config.get("use_aux_norm")),
                not config.get("rope_interleave", True),
                rope,
                rope_mscale,
                scale,
                problem,
            )
        else:
            reading = MlaReading(
                "vLLM",
                bool(config.get("norm_before_residual", False)),
                bool(config.get("fc_norm", False)),
                False,
                rope,
                rope_mscale,
                scale,
            )
        out[engine] = reading
    return out


def _rope_tables(reading: MlaReading, theta: float, dim: int, positions: torch.Tensor):
    """cos, sin [..., dim / 2] at ``positions``, in fp32 as both engines build their cache:
    ``theta ** (arange(0, dim, 2) / dim)``; with DeepSeek's YaRN the interpolated and
    extrapolated frequencies mixed by a linear ramp between the correction dims, and cos /
    sin times the magnitude ``mscale``."""
    device = positions.device
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim)
    rope = reading.rope
    if rope is None:
        freqs = positions.to(torch.float32).unsqueeze(-1) * (1.0 / pos_freqs)
        return freqs.cos(), freqs.sin()
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (rope["factor"] * pos_freqs)
    low, high = _correction_range(
        rope["beta_fast"], rope["beta_slow"], dim, theta, rope["original"]
    )
    if low == high:
        high += 0.001  # the engines' guard against a zero-width ramp
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float, device=device) - low) / (high - low), 0, 1
    )
    mask = (1 - ramp) * rope["extrapolation"]
    inv_freq = interpolation * (1 - mask) + extrapolation * mask
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return freqs.cos() * reading.rope_mscale, freqs.sin() * reading.rope_mscale


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, neox: bool):
    """x [B, T, heads, dim]; cos / sin [B, T, dim / 2]: the engines' forward_native."""
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if neox:
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
    else:
        cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
    return (x * cos + rotated * sin).to(x.dtype)


class _MlaLayer(nn.Module):
    """One draft decoder layer with MLA attention and a dense SiLU MLP; the first takes
    [embeds, hidden] (2H) into the attention's down projections."""

    def __init__(self, spec: DraftSpec, reading: MlaReading, first: bool):
        super().__init__()
        c = spec.layer_config
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.first, self.reading = first, reading
        self.heads = c["num_attention_heads"]
        self.q_lora_rank = c.get("q_lora_rank")
        self.kv_lora_rank = c["kv_lora_rank"]
        self.nope, self.rope_dim = c["qk_nope_head_dim"], c["qk_rope_head_dim"]
        self.v_dim = c["v_head_dim"]
        self.theta = _rope_parameters(c)[0]
        d_in = 2 * h if first else h
        qk = self.heads * (self.nope + self.rope_dim)
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(d_in, self.q_lora_rank, bias=False)
            self.q_a_layernorm = DraftNorm(self.q_lora_rank, eps)
            self.q_b_proj = nn.Linear(self.q_lora_rank, qk, bias=False)
        else:
            self.q_proj = nn.Linear(d_in, qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d_in, self.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = DraftNorm(self.kv_lora_rank, eps)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.heads * (self.nope + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.heads * self.v_dim, h, bias=False)
        act = c.get("hidden_act", _DEFAULTS["hidden_act"])
        if act != "silu":
            raise DraftError(f"draft hidden_act {act!r}: both engines' MLA drafts use a SiLU MLP")
        inter = c["intermediate_size"]
        self.gate_proj = nn.Linear(h, inter, bias=False)
        self.up_proj = nn.Linear(h, inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.input_layernorm = DraftNorm(h, eps)
        self.post_attention_layernorm = DraftNorm(h, eps)
        if first:
            self.hidden_norm = DraftNorm(h, eps)

    def attention(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(b, t, self.heads, self.nope + self.rope_dim)
        q_nope, q_pe = q.split([self.nope, self.rope_dim], -1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(
            b, t, self.heads, self.nope + self.v_dim
        )
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        cos, sin = _rope_tables(self.reading, self.theta, self.rope_dim, positions)
        q_pe = _apply_rope(q_pe, cos, sin, self.reading.neox)
        k_pe = _apply_rope(k_pe.unsqueeze(2), cos, sin, self.reading.neox)
        q = torch.cat([q_nope, q_pe], -1).transpose(1, 2)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.heads, -1)], -1).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            q, k, v.transpose(1, 2), is_causal=True, scale=self.reading.softmax_scale
        )
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))

    def forward(self, embeds, hidden, residual, positions):
        x, residual = attention_input(
            self, embeds, hidden, residual, self.reading.norm_before_residual
        )
        x = self.attention(x, positions)
        residual = x + residual
        x = self.post_attention_layernorm(residual)
        x = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return x, residual


class Eagle3MlaDraft(nn.Module):
    """The MLA draft's first step, with :class:`~eagle_capture.probe.draft.Eagle3Draft`'s
    interface (``spec``, ``combine``, ``forward``, ``to_target``, ``embed_tokens``, ``d2t``)
    so every engine mode of the probe scores it alike; ``reading`` says which engine's
    arithmetic it follows, ``notes`` what the probe should say about that."""

    def __init__(self, spec: DraftSpec, reading: MlaReading, notes: Optional[list] = None):
        super().__init__()
        self.spec, self.reading = spec, reading
        self.notes = list(notes or [])
        fc_in = spec.target_hidden_size * spec.num_aux
        self.fc_norm = (
            nn.ModuleList(
                DraftNorm(spec.target_hidden_size, spec.rms_norm_eps) for _ in range(spec.num_aux)
            )
            if reading.fc_norm
            else None
        )
        self.fc = nn.Linear(fc_in, spec.hidden_size, bias=False)
        self.layers = nn.ModuleList(
            _MlaLayer(spec, reading, first=(i == 0)) for i in range(spec.num_layers)
        )
        self.norm = DraftNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.embed_tokens: Optional[nn.Embedding] = None

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        if self.fc_norm is not None:
            chunks = aux.chunk(self.spec.num_aux, dim=-1)
            aux = torch.cat([n(c) for n, c in zip(self.fc_norm, chunks)], dim=-1)
        return self.fc(aux)

    def forward(
        self, aux: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """Draft-vocabulary logits [B, T, draft_vocab] (see the module's docstring)."""
        hidden = self.combine(aux)
        residual = None
        for layer in self.layers:
            hidden, residual = layer(embeds, hidden, residual, positions)
        return self.lm_head(self.norm(hidden + residual))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


_ENGINE_OF_MODE = {"vllm": "vllm", "sglang": "sglang"}


def mla_draft(config: dict, spec: DraftSpec, engine: str = "transformers") -> Eagle3MlaDraft:
    """An (untrained) :class:`Eagle3MlaDraft` for ``config`` as the engine of the probe's
    mode ``engine`` computes it ("vllm", "sglang"; "transformers": SGLang's reading, vLLM's
    where SGLang cannot run the draft)."""
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise DraftError(f"the MLA draft config has no positive integer {key}")
    if spec.norm_before_fc:
        raise DraftError(
            "norm_before_fc on an MLA draft: neither engine's "
            "Eagle3DeepseekV2ForCausalLM has that norm"
        )
    readings = engine_readings(config)
    notes = []
    if engine in _ENGINE_OF_MODE:
        reading = readings[_ENGINE_OF_MODE[engine]]
        if reading.problem:
            raise DraftError(reading.problem)
    else:
        sglang, vllm = readings["sglang"], readings["vllm"]
        reading = vllm if sglang.problem else sglang
        differ = sglang.differences(vllm)
        if sglang.problem:
            notes.append(f"the MLA draft's step is computed as vLLM computes it: {sglang.problem}")
        elif differ:
            notes.append(
                "SGLang and vLLM compute this MLA draft's step differently ("
                + "; ".join(differ)
                + "): measured as SGLang computes it; "
                "--engine vllm measures vLLM's"
            )
    return Eagle3MlaDraft(spec, reading, notes)
