"""The install of the fused capture on one vLLM EAGLE-3 model (what
:meth:`set_aux_hidden_state_layers` of :mod:`eagle_capture.integrations.vllm.model`'s
classes runs), and its undoing.

vLLM captures id ``k`` as the input of decoder layer ``k`` -- ``hidden_states +
residual``, an extra add -- and id ``num_layers`` after the last layer, before the
final norm. That sum is exactly the new residual that layer ``k``'s input norm
(vLLM's fused add + RMSNorm, in place) computes next. The install therefore swaps
the input norm of each captured layer (the final norm for id ``num_layers``) for
a capturing subclass of its own class (:mod:`.norms`) that stores the new residual
into the layer's slot of a persistent ``[max_tokens, K, H]`` buffer (:mod:`.state`,
rows from :mod:`.sizing`), and puts the install into
``additional_config["eagle_capture"]``, which vLLM's torch.compile cache key hashes.

Refused, with the reason (the server does not start; :class:`WrongCaptureLayers`):
ids the shared validation refuses (:func:`.checked.check_layer_ids`), MiniMax-M2 at
PP > 1 (its loop numbers ids per stage), a draft whose input width is not ``K x H``,
ids the draft was not trained on. Left to vLLM's own capture, logged
(:class:`UnsupportedServer`): not the last pipeline stage, PP > 1 for the families
whose loop carries the captures over stages, sequence-parallel MoE (rows
token-scattered over TP), a norm other than vLLM's plain weighted ``RMSNorm``, a
device the kernels do not run on.
"""

from __future__ import annotations

import re
from typing import Optional

import torch
from vllm.distributed import get_pp_group

from eagle_capture import ops
from eagle_capture.buffer import AuxCaptureBuffer
from eagle_capture.integrations import settings
from eagle_capture.integrations.core.errors import UnsupportedServer, WrongCaptureLayers
from eagle_capture.integrations.core.log import rank_or_unknown
from eagle_capture.integrations.vllm.checked import check_draft_ids, check_layer_ids
from eagle_capture.integrations.vllm.families import CARRIED, STAGE_RELATIVE, Family
from eagle_capture.integrations.vllm.norms import (
    NOBODY,
    POST_NORM,
    capturing_class,
    plain_rmsnorm,
    slot_taking_norm,
)
from eagle_capture.integrations.vllm.sizing import buffer_rows
from eagle_capture.integrations.vllm.state import CaptureState, log

__all__ = [
    "ADDITIONAL_CONFIG_KEY",
    "draft_width_problem",
    "fused_add_rms_norm_provider",
    "install",
    "keeps_allreduce_fusion",
    "uninstall",
]

# The key of the install in vLLM's additional_config, which its compile-cache key hashes.
ADDITIONAL_CONFIG_KEY = "eagle_capture"


def keeps_allreduce_fusion(vllm_config, compiled: bool) -> bool:
    """Whether vLLM's compile runs its all-reduce + RMSNorm fusion pass here
    (``pass_config.fuse_allreduce_rms``: on by default at TP > 1 on Hopper /
    Blackwell with FlashInfer). The pass matches ``all_reduce`` followed by vLLM's
    ``fused_add_rms_norm`` IR op; a captured norm replaced by the project's op
    would leave that layer's all-reduce unfused, so the capture goes after vLLM's
    norm instead (a copy of its residual)."""
    from vllm.distributed import get_tensor_model_parallel_world_size

    pass_config = getattr(getattr(vllm_config, "compilation_config", None), "pass_config", None)
    return (
        compiled
        and bool(getattr(pass_config, "fuse_allreduce_rms", False))
        and get_tensor_model_parallel_world_size() > 1
    )


def fused_add_rms_norm_provider(like: torch.Tensor) -> str:
    """Which implementation of vLLM's ``fused_add_rms_norm`` runs for tensors
    like ``like`` (its IR op's current priority)."""
    from vllm import ir

    op = ir.ops.fused_add_rms_norm
    x = torch.zeros(2, like.shape[-1], dtype=like.dtype, device=like.device)
    return op.dispatch(x, x.clone(), torch.ones_like(x[0]), 1e-6, None).provider


def _draft_hf_config(vllm_config):
    """The EAGLE-3 draft's config as vLLM parsed it, or None (no draft here)."""
    spec = getattr(vllm_config, "speculative_config", None)
    return getattr(getattr(spec, "draft_model_config", None), "hf_config", None)


def _nested_ids(draft) -> Optional[list]:
    eagle = getattr(draft, "eagle_config", None)
    return eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None


def _draft_fc_width(draft) -> int:
    """How many hidden states vLLM's EAGLE-3 class for ``draft`` sizes its fc for: the
    class's own rule, read from this vLLM's wheel (engine facts ``eagle3_draft_fc``:
    Llama's and DeepSeek's drafts take ``num_aux_hidden_states``, else eagle_config's ids'
    count, else 3; Qwen3's also the top-level ids); where this release or class was not
    read, Llama's rule."""
    import vllm

    from eagle_capture.layer_ids import engine_facts

    def read(key):
        if key.startswith("eagle_config."):
            nested = getattr(draft, "eagle_config", None)
            return nested.get(key.split(".", 1)[1]) if isinstance(nested, dict) else None
        return getattr(draft, key, None)

    # "0.32.0+cpu", "0.34.0rc2.dev5": the release numbers
    version = re.match(r"(\d+)\.(\d+)\.(\d+)", vllm.__version__)
    release = version and engine_facts.read_release("vllm", tuple(map(int, version.groups())))
    archs = getattr(draft, "architectures", None) or [""]
    sized = engine_facts.vllm_draft_fc(release, archs[0], read) if release else None
    if sized is not None:
        return sized[0]
    ids = _nested_ids(draft)
    return getattr(draft, "num_aux_hidden_states", None) or (len(ids) if ids else 3)


def draft_width_problem(vllm_config, num_captures: int, hidden_size: int) -> Optional[str]:
    """The draft's fc input (:func:`_draft_fc_width`) vs what the target captures."""
    draft = _draft_hf_config(vllm_config)
    if draft is None:
        return None
    expected = _draft_fc_width(draft)
    target_hidden = getattr(draft, "target_hidden_size", None) or hidden_size
    if expected != num_captures or target_hidden != hidden_size:
        return (
            f"the draft expects {expected} x {target_hidden} input features but the target "
            f"captures {num_captures} layers of width {hidden_size}"
        )
    return None


def install(causal_lm, layers) -> CaptureState:
    """Install the fused capture of ``layers`` (vLLM's ids) on ``causal_lm``."""
    from vllm.config import get_current_vllm_config

    model = causal_lm.model
    config = causal_lm.config
    family: Family = causal_lm._eagle_family
    num_layers = int(config.num_hidden_layers)
    hidden = int(config.hidden_size)
    pp = get_pp_group()
    if pp.world_size > 1 and family.pipeline == CARRIED:
        raise UnsupportedServer(
            f"{pp.world_size} pipeline stages: vLLM's {family.name} loop carries the earlier "
            f"stages' captures to the last one (IntermediateTensors); the fused capture serves "
            f"one stage"
        )
    if pp.world_size > 1 and family.pipeline == STAGE_RELATIVE:
        raise WrongCaptureLayers(
            f"eagle_capture: {pp.world_size} pipeline stages: vLLM's {family.name} loop numbers "
            f"the aux ids from its stage's first layer (layers {model.start_layer}.."
            f"{model.end_layer - 1} here), so on the last stage id k captures the input of "
            f"layer start + k, not of layer k: the draft would get other layers than "
            f"{list(layers)}. Serve without pipeline parallelism"
        )
    if not pp.is_last_rank:
        raise UnsupportedServer(
            "not the last pipeline stage (vLLM drops aux hidden states "
            "captured here; its runner asks only the last stage)"
        )
    captured = check_layer_ids(
        layers, num_layers, model.start_layer, model.end_layer, family.embedding_id
    )
    vllm_config = getattr(model, "vllm_config", None) or get_current_vllm_config()
    problem = draft_width_problem(vllm_config, len(captured), hidden)
    if problem:
        raise WrongCaptureLayers(f"eagle_capture: {problem}")
    check_draft_ids(causal_lm, layers, vllm_config)  # what the draft was trained on
    decoder_layers = [model.layers[i] for i in range(model.start_layer, model.end_layer)]
    if any(getattr(layer, "use_sequence_parallel_moe", False) for layer in decoder_layers):
        raise UnsupportedServer(
            "sequence-parallel MoE: the captured rows are token-scattered "
            "over the TP group and vLLM all-gathers each capture"
        )
    norms = {
        i: (model.norm if i == model.end_layer else model.layers[i].input_layernorm)
        for i in captured
    }
    for i, norm in norms.items():
        if not plain_rmsnorm(norm):
            raise UnsupportedServer(
                f"layer {i}'s norm is {type(norm).__name__} (the fused "
                f"capture replaces vLLM's plain weighted RMSNorm)"
            )
    weight = norms[captured[0]].weight
    if weight.device.type not in ops.KERNEL_DEVICE_TYPES | {"cpu"} or torch.version.hip:
        raise UnsupportedServer(
            f"the model is on {weight.device} "
            f"({'ROCm' if torch.version.hip else weight.device.type}): the "
            f"kernels run on CUDA and the CPU path on CPU"
        )
    compiled = not getattr(model, "do_not_compile", True)
    rows, rows_reason = buffer_rows(vllm_config, compiled)
    # Match vLLM's own norm: its native implementation (CPU, and CUDA under
    # Inductor) normalises the fp32 sum; its CUDA kernel (enforce_eager) the
    # rounded one. The capture itself is the rounded sum either way.
    provider = fused_add_rms_norm_provider(weight)
    norm_fp32_sum = provider != "vllm_c"
    buffer = AuxCaptureBuffer(rows, hidden, captured, dtype=weight.dtype, device=weight.device)
    state = CaptureState(buffer, norm_fp32_sum, provider, compiled)
    state.keep_allreduce_fusion = keeps_allreduce_fusion(vllm_config, compiled)
    state.start_verify(settings.verify_forwards())
    if state.verify_total and compiled:
        log().warning(
            "eagle_capture: %s=%d needs eager forwards (enforce_eager): the layer "
            "loop is compiled here, no self-check runs",
            settings.VERIFY,
            state.verify_total,
        )
        state.start_verify(0)
    for slot, i in enumerate(captured):
        norm = norms[i]
        norm.__class__ = capturing_class(type(norm))
        norm._eagle_capture_state = state
        norm._eagle_capture_slot = slot
        norm._eagle_capture_layer = i
        post = (
            getattr(model.layers[i], "post_attention_layernorm", None)
            if i < model.end_layer
            else None
        )
        if i == model.end_layer:
            norm._eagle_slot_reader = NOBODY
        elif i > 0 and plain_rmsnorm(post):
            norm._eagle_slot_reader = POST_NORM
            post.__class__ = capturing_class(type(post), slot_taking_norm)
            post._eagle_capture_state = state
            post._eagle_capture_layer = i
        else:
            norm._eagle_slot_reader = None  # no residual-in-slot: a norm we do not know reads it
    additional = getattr(vllm_config, "additional_config", None)
    if isinstance(additional, dict):
        additional[ADDITIONAL_CONFIG_KEY] = {
            "layers": captured,
            "rows": rows,
            "norm_fp32_sum": norm_fp32_sum,
            "keep_allreduce_fusion": state.keep_allreduce_fusion,
        }
    elif compiled:
        log().warning(
            "eagle_capture: vLLM's additional_config is not a dict here: set "
            "VLLM_DISABLE_COMPILE_CACHE=1 so that no graph compiled without the "
            "capture is loaded"
        )
    nbytes = buffer.aux.numel() * buffer.aux.element_size()
    default = tuple(captured) == (2, num_layers // 2, num_layers - 3)
    log().info(
        "eagle_capture: fused EAGLE-3 capture ON (vLLM, %s, %s family, TP rank %s): ids %s = "
        "inputs of layers %s%s -> slots 0..%d, buffer [%d, %d, %d] %s = %.1f MiB on %s (%s); "
        "norm as vLLM's %s fused_add_rms_norm (%s sum); %s%s",
        type(causal_lm).__name__,
        family.name,
        _tp_rank(),
        list(layers),
        captured,
        " (vLLM's defaults)" if default else "",
        len(captured) - 1,
        rows,
        len(captured),
        hidden,
        str(weight.dtype).replace("torch.", ""),
        nbytes / 2**20,
        weight.device,
        rows_reason,
        provider,
        "fp32" if norm_fp32_sum else "rounded",
        (
            "traced into vLLM's torch.compile graph"
            + (
                " after vLLM's own norm, which its all-reduce + RMSNorm fusion pass keeps fusing"
                if state.keep_allreduce_fusion
                else ""
            )
        )
        if compiled
        else "eager, the new residual written into the slot only (no extra write)",
        f"; self-check of the first {state.verify_total} forwards" if state.verify_total else "",
    )
    return state


def uninstall(causal_lm) -> None:
    """vLLM's own norms and capture back (a later install starts from them)."""
    state = causal_lm.__dict__.pop("_eagle_capture", None)
    model = causal_lm.model
    for norm in [
        getattr(layer, name, None)
        for layer in model.layers
        for name in ("input_layernorm", "post_attention_layernorm")
    ] + [getattr(model, "norm", None)]:
        base = getattr(type(norm), "_eagle_capture_base", None)
        if base is not None:
            norm.__class__ = base
            for name in (
                "_eagle_capture_state",
                "_eagle_capture_slot",
                "_eagle_capture_layer",
                "_eagle_slot_reader",
            ):
                norm.__dict__.pop(name, None)
    if state is not None:
        model.aux_hidden_state_layers = ()


def _tp_rank():
    def rank():
        from vllm.distributed import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()

    return rank_or_unknown(rank)
