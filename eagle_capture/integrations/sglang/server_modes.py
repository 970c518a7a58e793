"""What SGLang is running: its server arguments and the modes its model runner set
up (DP attention, attention-TP width, token-scattered rows, two-batch overlap, the
hidden states returned with responses, capture-only mode, ...),
whether it is capturing a CUDA graph or running its compiled layer loop now, and
the server modes the fused capture refuses. Read through each line's own helpers
(0.5.9 - 0.5.23); family-neutral."""

import sys
from typing import Optional

import torch

from eagle_capture.integrations.core.errors import UnsupportedServer

__all__ = [
    "allreduce_fusion_max_tokens",
    "attention_tp_gather",
    "attention_tp_size",
    "aux_capture_only",
    "capture_only_of_args",
    "capturing_cuda_graph",
    "dp_attention_enabled",
    "ffn_on_rank_rows",
    "flashinfer_allreduce_unavailable",
    "in_compiled_region",
    "refuse_unsupported_modes",
    "return_hidden_states_mode",
    "return_mode_of_args",
    "rows_may_scatter",
    "runtime_modes",
    "scattered_captures",
    "server_args",
    "UnsupportedServer",
]


def flashinfer_allreduce_unavailable() -> Optional[bool]:
    fn = getattr(
        sys.modules.get("sglang.srt.layers.flashinfer_comm_fusion"),
        "is_flashinfer_allreduce_unavailable",
        None,
    )
    try:
        return bool(fn()) if fn is not None else None
    except Exception:  # noqa: BLE001
        return None


def capturing_cuda_graph(like: torch.Tensor) -> bool:
    return like.is_cuda and torch.cuda.is_current_stream_capturing()


def in_compiled_region() -> bool:
    """Whether SGLang is running the piecewise-compiled layer loop now (its
    compiled code does not rerun our norms' Python)."""
    compile_module = sys.modules.get("sglang.srt.compilation.compile")
    # The trampoline's own switch: the _COMPILE_ENABLED context variable in 0.5.9,
    # is_in_piecewise_cuda_graph() in 0.5.13, is_in_tc_piecewise_cuda_graph() from 0.5.18.
    flag = (
        getattr(compile_module, "is_in_tc_piecewise_cuda_graph", None)
        or getattr(compile_module, "is_in_piecewise_cuda_graph", None)
        or getattr(getattr(compile_module, "_COMPILE_ENABLED", None), "get", None)
    )
    try:
        return bool(flag()) if flag is not None else False
    except Exception:  # noqa: BLE001 - a flag we cannot read is "not compiled"
        return False


def allreduce_fusion_max_tokens() -> int:
    """The largest forward SGLang's FlashInfer all-reduce + add + RMSNorm fusion
    may take at a post-attention norm (its FUSE_ALLREDUCE_MAX_BATCH_SIZE, read
    where the running line defines it); 0 at tensor-parallel size 1. Whether the
    fusion is on is not read: a forward it does not take only loses the residual-in-slot path."""
    try:
        from sglang.srt.distributed import get_tensor_model_parallel_world_size

        tp = get_tensor_model_parallel_world_size()
    except Exception:  # noqa: BLE001 - not an SGLang process (or not initialised)
        return 0
    if tp <= 1:
        return 0
    for name in ("sglang.srt.layers.communicator", "sglang.srt.layers.layer_boundary"):
        limit = getattr(sys.modules.get(name), "FUSE_ALLREDUCE_MAX_BATCH_SIZE", None)
        if isinstance(limit, int):
            return limit
    return 2048  # the value of every line read (0.5.9 - 0.5.23)


def server_args():
    """SGLang's server arguments where this version exposes them (the accessor
    moved: ``runtime_context.get_server_args`` in 0.5.22+, before that
    ``server_args.get_global_server_args``); None outside a server."""
    for module_name, getter in (
        ("sglang.srt.runtime_context", "get_server_args"),
        ("sglang.srt.server_args", "get_global_server_args"),
    ):
        fn = getattr(sys.modules.get(module_name), getter, None)
        if fn is None:
            continue
        try:
            args = fn()
        except Exception:  # noqa: BLE001 - retired or not initialised
            continue
        if args is not None:
            return args
    return None


def _resolved(args, name: str, default=None):
    """``name`` as SGLang resolved it on the ``args`` record: 0.5.20+ keep the
    command line on the record and the resolution in its declaration stash
    (``arg_groups.overrides.resolution_result``); earlier lines resolve the
    record's own fields in place."""
    if args is None:
        return default
    overrides = sys.modules.get("sglang.srt.arg_groups.overrides")
    resolution_result = getattr(overrides, "resolution_result", None)
    if resolution_result is not None:
        try:
            value = resolution_result(args, name, default)
            return default if value is None else value
        except Exception:  # noqa: BLE001 - a record this line's resolver cannot read
            pass
    value = getattr(args, name, default)
    return default if value is None else value


_CAPTURE_HIDDEN_MODES = {"NULL": None, "LAST": "last", "FULL": "full"}


def return_hidden_states_mode(args=None) -> Optional[str]:
    """The most hidden states this server hands back with a response: None, "last"
    or "full" -- what SGLang itself decides it is, on every line:

    * 0.5.18+: its own ``forward_batch_info.get_server_return_hidden_states_mode()``
      (the published ``get_exec().features``), when this process has them;
    * else its rule on the server arguments (``--return-hidden-states-mode``; unset,
      ``--enable-return-hidden-states`` or 0.5.23's ``--enable-return-aux-hidden-states``
      make it "full"), read resolved (``_resolved``). 0.5.13 has only the flag.

    From 0.5.20 the record's raw ``enable_return_hidden_states`` stays False under
    ``--return-hidden-states-mode full|last`` and under capture-only mode: it is not
    the answer."""
    fbi = sys.modules.get("sglang.srt.model_executor.forward_batch_info")
    runtime = getattr(fbi, "get_server_return_hidden_states_mode", None)
    if runtime is not None:
        try:
            name = getattr(runtime(), "name", None)
        except Exception:  # noqa: BLE001 - nothing published in this process
            name = None
        if name in _CAPTURE_HIDDEN_MODES:
            return _CAPTURE_HIDDEN_MODES[name]
    return return_mode_of_args(server_args() if args is None else args)


def return_mode_of_args(args) -> Optional[str]:
    """SGLang's rule on its (resolved) server arguments: ``handle_return_hidden_states_mode``
    (0.5.20+; ``ServerArgs._handle_return_hidden_states_mode`` in 0.5.18), the flag alone
    on 0.5.13."""
    mode = _resolved(args, "return_hidden_states_mode")
    if mode in ("last", "full"):
        return mode
    if _resolved(args, "enable_return_hidden_states", False) or _resolved(
        args, "enable_return_aux_hidden_states", False
    ):
        return "full"
    return None


def aux_capture_only(args=None) -> Optional[str]:
    """The capture convention ("eagle3", "dflash", "dspark") when the server captures
    aux hidden states for its responses WITHOUT a draft (0.5.23's
    ``--enable-return-aux-hidden-states``: ``--speculative-algorithm`` then only
    names the convention and is resolved to None); None otherwise. Read where
    SGLang's model runner reads it (``get_exec().features.aux_hidden_state_capture``),
    else from the resolved arguments."""
    rc = sys.modules.get("sglang.srt.runtime_context")
    get_exec = getattr(rc, "get_exec", None)
    if get_exec is not None:
        try:
            features = get_exec().features
            if "aux_hidden_state_capture" in features:
                return features.aux_hidden_state_capture or None
        except Exception:  # noqa: BLE001 - nothing published in this process
            pass
    return capture_only_of_args(server_args() if args is None else args)


def capture_only_of_args(args) -> Optional[str]:
    """:func:`aux_capture_only` from the server arguments: the resolved
    ``aux_hidden_state_capture``, else the raw flag with the convention its
    ``--speculative-algorithm`` names (``handle_aux_hidden_state_capture``, 0.5.23)."""
    method = _resolved(args, "aux_hidden_state_capture")
    if method:
        return str(method).lower()
    if _resolved(args, "enable_return_aux_hidden_states", False):
        return str(getattr(args, "speculative_algorithm", None) or "eagle3").lower()
    return None


def runtime_modes() -> dict:
    """The modes SGLang's model runner really set up, from its own runtime helpers
    (every line 0.5.9 - 0.5.23): from 0.5.20 the server-args record keeps only the
    command line, so auto-enabled modes (DeepSeek-V3.2's prefill context
    parallelism turning on DP attention and DeepEP, say) are missing there."""

    def call(module_name, fn_name):
        fn = getattr(sys.modules.get(module_name), fn_name, None)
        try:
            return fn() if fn is not None else None
        except Exception:  # noqa: BLE001 - not initialised in this process
            return None

    a2a = call("sglang.srt.layers.moe.utils", "get_moe_a2a_backend")
    is_none = getattr(a2a, "is_none", None)
    parallel = call("sglang.srt.runtime_context", "get_parallel")
    return {
        "enable_dp_attention": call("sglang.srt.layers.dp_attention", "is_dp_attention_enabled"),
        "enable_two_batch_overlap": call("sglang.srt.layers.moe.utils", "is_tbo_enabled"),
        "moe_a2a_backend": None if is_none is None or is_none() else getattr(a2a, "value", a2a),
        # 0.5.9 / 0.5.13 have the helper; 0.5.20+ only the parallel context.
        "attn_cp_size": next(
            (
                v
                for v in (
                    call("sglang.srt.layers.dp_attention", "get_attention_cp_size"),
                    getattr(parallel, "attn_cp_size", None),
                )
                if v is not None
            ),
            None,
        ),
        "enable_layernorm_sp": getattr(parallel, "enable_layernorm_sp", None),
    }


def attention_tp_size() -> Optional[int]:
    """The attention-TP group's size (SGLang's ``get_attn_tp_group``, every line
    0.5.9 - 0.5.23: the TP group without DP attention, tp_size / dp_size with
    it); 1 outside a distributed SGLang process; None if it cannot be read."""
    ps = sys.modules.get("sglang.srt.distributed.parallel_state")
    if ps is None:
        return 1
    try:
        return int(ps.get_attn_tp_group().world_size)
    except Exception:  # noqa: BLE001 - groups not initialised: a single process
        initialised = getattr(ps, "model_parallel_is_initialized", None)
        try:
            return None if initialised is not None and initialised() else 1
        except Exception:  # noqa: BLE001
            return None


def scattered_captures(model: torch.nn.Module, layer_ids: list[int]) -> frozenset:
    """Captured layers whose input rows are token-scattered over the attention-TP
    group, as SGLang lays them out: <= 0.5.20 its own ``layer_scatter_modes``
    (input mode SCATTERED); 0.5.22+ its rule (the previous layer ran its FFN on
    this rank's rows: a sparse layer under an all-to-all MoE backend, a dense one
    with moe_dense_tp_size 1). None with an attention-TP group of one rank. A
    wrong prediction is caught by the completeness check (the rows stored)."""
    if attention_tp_size() == 1:
        return frozenset()
    moe_utils = sys.modules.get("sglang.srt.layers.moe.utils")
    scattered_fn = getattr(moe_utils, "is_moe_input_scattered_across_dp_ranks", None)
    if scattered_fn is None:
        a2a = getattr(moe_utils, "get_moe_a2a_backend", None)
        scattered_fn = (lambda: not a2a().is_none()) if a2a is not None else (lambda: False)
    args = server_args()
    dense_on_rank_rows = getattr(args, "moe_dense_tp_size", None) == 1
    out = set()
    for i in layer_ids:
        modes = getattr(
            getattr(model.layers[i], "layer_communicator", None), "layer_scatter_modes", None
        )
        if modes is not None:
            if getattr(modes.layer_input_mode, "name", None) == "SCATTERED":
                out.add(i)
            continue
        previous = model.layers[i - 1]
        if scattered_fn() if getattr(previous, "is_layer_sparse", False) else dense_on_rank_rows:
            out.add(i)
    return frozenset(out)


def ffn_on_rank_rows() -> Optional[str]:
    """Why some layer runs its FFN on this rank's share of the rows (an all-to-all
    MoE backend; moe_dense_tp_size 1), or None: with an attention-TP group of
    several ranks that scatters the rows over it. The backend is read from
    SGLang's runtime first (it may turn one on itself), then the server args."""
    args = server_args()
    a2a = runtime_modes().get("moe_a2a_backend")
    if a2a is None and args is not None:
        a2a = getattr(args, "moe_a2a_backend", None)
    reasons = []
    if a2a not in (None, "none"):
        reasons.append(f"an all-to-all MoE (moe_a2a_backend={a2a!r})")
    if args is not None and getattr(args, "moe_dense_tp_size", None) == 1:
        reasons.append("moe_dense_tp_size=1")
    return " and ".join(reasons) or None


def rows_may_scatter() -> bool:
    return attention_tp_size() != 1 and ffn_on_rank_rows() is not None


def attention_tp_gather(rows: torch.Tensor) -> torch.Tensor:
    """Every attention-TP rank's ``rows`` stacked in rank order, by SGLang's own
    group (``GroupCoordinator.all_gather(dim=0)``: its communicator)."""
    from sglang.srt.distributed.parallel_state import get_attn_tp_group

    return get_attn_tp_group().all_gather(rows.contiguous(), dim=0)


def dp_attention_enabled() -> bool:
    modes = runtime_modes()
    if modes.get("enable_dp_attention"):
        return True
    args = server_args()
    return bool(getattr(args, "enable_dp_attention", False)) if args is not None else False


def refuse_unsupported_modes() -> None:
    args = server_args()
    modes = runtime_modes()

    def mode(name, default):
        runtime = modes.get(name)
        if runtime not in (None, False, default):
            return runtime
        return getattr(args, name, default) if args is not None else default

    refused = []
    if mode("enable_two_batch_overlap", False):
        refused.append(
            "two-batch overlap (enable_two_batch_overlap): the input norm runs on "
            "half-batches, each of which would overwrite the slot's first rows"
        )
    # DP attention is served: each rank's input norm sees that rank's own (padded)
    # rows, exactly what SGLang captures there and hands that rank's draft. Rows
    # token-scattered over an attention-TP group of several ranks (an all-to-all
    # MoE backend after sparse layers, moe_dense_tp_size 1 after dense ones) are
    # gathered (scattered_captures), which needs the group's size.
    on_rank_rows = ffn_on_rank_rows()
    if attention_tp_size() is None and on_rank_rows:
        refused.append(
            f"{on_rank_rows} with an attention-TP group whose size cannot be read: "
            f"the captured rows may be scattered over it"
        )
    cp = mode("attn_cp_size", 1)
    if cp not in (None, 1):
        refused.append(
            f"context parallelism (attn_cp_size={cp}): each rank holds a slice of the tokens"
        )
    if mode("enable_layernorm_sp", False):
        # SGLang itself refuses it for DeepSeek / Kimi and for any speculative
        # decoding (0.5.20 - 0.5.23); refused here too, should that change.
        refused.append(
            "layernorm sequence parallelism (enable_layernorm_sp): the residual is "
            "row-sharded over the TP group at the input norm"
        )
    if refused:
        raise UnsupportedServer(
            "eagle_capture: install_eagle3_capture does not support "
            + "; ".join(refused)
            + ". Keep SGLang's own capture for this "
            "server"
        )
