"""Run the REAL SGLang DeepseekV2 model code on CPU with EAGLE-3 capture on.

What this is
------------
A harness that imports SGLang's own wheel (one version per process: run each
version in its own subprocess), builds SGLang's own
``sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM`` from a tiny
``transformers.DeepseekV3Config`` (``eagle_capture.testing.models``: 6 layers, hidden 64, vocab 128, q_lora_rank
48, kv_lora_rank 32, yarn rope with rope_theta, first_k_dense_replace 2, 4
routed experts) on CPU, turns EAGLE-3 capture on with the model's own
``set_eagle3_layers_to_capture(ids)``, runs the model's own ``forward`` and
returns what the model hands to its LogitsProcessor and what that returns.

API: ``setup(version=None, dtype=None, hf_config=None, version_dir=None, *,
tp_size=1, rank=0, init_method=None, dist_timeout=None)``,
``build_model(num_layers, hidden_size, dtype, capture_ids, seed, arch, set_capture,
standin)``, ``tp_world_size()``, ``tp_rank()``,
``make_batch(model, num_tokens, mode="extend"|"decode", seed=0, capture="full"|"last")`` ->
(input_ids, positions, forward_batch), ``run(model, batch)`` ->
a ``LogitsCall`` (what the model handed its LogitsProcessor, and its
output), ``draft_input(call)`` (what the EAGLE-3 draft receives),
``sglang_version()``, ``build(...)`` = build_model + ``SURFACE`` filled in.

Set-up (outside this file)::

    OVERLAY=$(tools/sglang_real_env.sh 0.5.13)       # cached, idempotent
    PYTHONPATH=$OVERLAY .venv/bin/python -m tests.sglang_real.harness --version 0.5.13
    .venv/bin/python tests/sglang_real/smoke.py 0.5.13   # does both itself

Real (SGLang's code, unmodified)
    * the import graph of ``sglang.srt.models.deepseek_v2`` (GPU-only
      packages stubbed by ``stubs.py``; a stub raises ``StubCalled`` if ever
      called, so no GPU path can run silently);
    * process set-up as SGLang's scheduler / model runner does it, per
      version (``SURFACE['init_calls']`` lists what ran):
      ``ServerArgs(model_path="dummy", device="cpu")`` published with
      ``set_global_server_args_for_scheduler`` (<= 0.5.20) or
      ``runtime_context.publish(role="scheduler", ranks=SpawnRanks(0))``
      (0.5.22, 0.5.23: the legacy shim publishes no rank placement);
      ``init_distributed_environment`` (world 1, backend "gloo",
      tcp://127.0.0.1:<free port>); ``initialize_model_parallel`` (TP 1);
      ``initialize_dp_attention``; ``initialize_layernorm_sp`` (0.5.20) /
      ``bootstrap.init_layer_runtime`` (0.5.22, 0.5.23);
      ``initialize_moe_config``. Where these read a ModelConfig, they get a
      namespace with hidden_size, dtype and hf_config (the fields they read);
    * ``DeepseekV2ForCausalLM.__init__`` (every layer, incl. MLA attention and
      the MoE blocks, is really constructed), ``DeepseekV2ForCausalLM.forward``,
      ``DeepseekV2Model.forward`` with its own capture loop / packer,
      ``DeepseekV2DecoderLayer.forward``, the ``LayerCommunicator``
      (<= 0.5.20) or the ``attn_boundary``/``ffn_boundary`` StageBoundary and
      the residual stream (0.5.22, 0.5.23), SGLang's ``RMSNorm`` for
      input_layernorm, post_attention_layernorm and the final norm,
      ``VocabParallelEmbedding``, a real ``ForwardBatch`` with a real
      ``ForwardMode`` (EXTEND, DECODE, IDLE for T = 0) and
      ``CaptureHiddenMode`` (FULL as an EAGLE-3 target runs, or LAST);
    * the ``LogitsProcessor`` (``causal_lm.logits_processor``: SGLang's own
      class, its own forward with the ``LogitsMetadata`` it builds from the
      batch, the model's own ``lm_head``, N(0, 1) weights): what the draft
      receives is its output's ``hidden_states`` (``draft_input``), so the aux
      type and layout each line hands over (a list of K [T, H] <= 0.5.13, a
      packed [T, K*H] tensor from 0.5.18) go through the wheel's own
      concatenation / packing. A subclass keeps each call's inputs and output
      (``records``) and changes nothing else;
    * RMSNorm runs ``forward_native`` (pure torch) in every version: on a
      machine without CUDA/HIP/NPU/XPU/MUSA and without
      ``SGLANG_USE_CPU_ENGINE=1`` (which this module unsets), the dispatch
      (``MultiPlatformOp.dispatch_forward`` <= 0.5.13,
      ``BaseFusedOp._resolve_forward_method`` >= 0.5.18) falls through to
      ``forward_native``. smoke.py asserts it for every norm that ran.

Stood in
    * ``layer.self_attn`` and ``layer.mlp`` of every decoder layer: a
      ``StandIn`` module that accepts the real call's *args/**kwargs, takes
      ``hidden_states`` (keyword or first positional) and returns
      ``0.5 * tanh(h @ W^T)`` computed in fp32 and cast back, W seeded per
      layer and role (deterministic, row-wise). Other attributes are read
      from the replaced real module (e.g. >= 0.5.20's
      ``self_attn.maybe_use_decode_attn_tp(forward_batch)`` runs for real).
      Since ``isinstance(layer.mlp, DeepseekV2MoE)`` is False, the layer's
      MoE-only branch (``moe_output_buffer_ctx``) is not taken;
    * weights: not loaded; the embedding is N(0, 1), every RMSNorm weight is
      1 + 0.1 * N(0, 1) (so a wrong norm weight is visible). The real
      attention / MoE weights are never used.

Tensor parallel (``setup(tp_size=2, rank=r, init_method="tcp://127.0.0.1:<port>")``
in each of two processes; ``tp_scenarios.py`` / ``tests/test_sglang_real_tp.py``)
    Real, in addition to the above: SGLang's own world-2 set-up, mirroring
    run_scheduler_process + the model runner: ``ServerArgs(tp_size=2,
    device="cpu", disable_custom_all_reduce=True)`` published as at TP 1 (0.5.22,
    0.5.23: ``SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=r,
    pp_rank=0))``), ``set_custom_all_reduce``, ``init_distributed_environment(
    world_size=2, rank=r, backend="gloo")``, ``initialize_model_parallel(
    tensor_model_parallel_size=2)`` (0.5.23: ``initialize_model_parallel()``, the
    widths read from the published context), then the same calls as at TP 1.
    The process groups (GroupCoordinator, gloo cpu/device groups), the
    vocab-sharded ``VocabParallelEmbedding`` (loaded from the full table by its
    own ``weight_loader``) and its all-reduce, and every all-reduce of the
    hidden states are SGLang's: the TP stand-in (``RowParallelStandIn``,
    ``standin="row_parallel"``, the only one allowed at TP > 1) returns
    ``act(h)[:, cols_r] @ W[:, cols_r]^T`` -- rank r's half of the input
    columns, through SGLang's own ``RowParallelLinear`` whose weight SGLang's
    ``weight_loader`` shards -- so only the sum over ranks is the layer's
    output (``act = 0.5 * tanh``; at TP 1 the same stand-in is the full
    contraction, which the TP 2 run is compared with). Whether the stand-in's
    RowParallelLinear reduces (``reduce_results``) is read off the replaced real
    module: attention's ``o_proj.reduce_results`` (False in every line: the
    communicator's prepare_mlp <= 0.5.20 / the ffn_boundary 0.5.22+ reduces),
    the dense MLP's ``down_proj.reduce_results`` and the MoE's
    ``reduce_results`` (True <= 0.5.20: the module reduces itself; False from
    0.5.22: the stage boundary sums). Verified per line: 15 all-reduces per
    forward (embedding + 2 per layer), asked for by
    ``VocabParallelEmbedding.forward`` and, <= 0.5.20, 7 x
    ``CommunicateWithAllReduceAndLayerNormFn._gather_hidden_states_and_residual``
    (after attention) + 7 x ``RowParallelLinear.forward`` (the MLP / MoE
    stand-in's, reduce_results=True); 0.5.22+, 7 x ``layer_boundary.ops.
    attn_tp_all_reduce`` + 6 x ``layer_boundary.output.UnreducedOutput.complete``
    + 1 x ``moe.utils._post_experts_sum`` (the last layer's FFN sum).
    Stood in: as above. The ``tanh`` stand-in is refused at TP > 1 (it would
    hand SGLang's all-reduce the full output on every rank).

DP attention (``setup(tp_size=2, dp_size=2, ...)``; ``dp_scenarios.py`` /
``tests/test_sglang_real_dp.py``)
    Real, in addition: ``ServerArgs(enable_dp_attention=True, dp_size=2)`` (0.5.20+
    with CUDA graphs disabled in its ``cuda_graph_config``: model_path "dummy"
    skips the resolution that fills it), the DP rank published (0.5.22+),
    ``initialize_model_parallel`` with the attention-DP width, every rank's own
    batch through ``make_dp_batch`` (the scheduler's token-count all-gather over
    the TP CPU group, then SGLang's ``prepare_mlp_sync_batch`` with a stand-in
    model runner of the fields it reads, and ``post_forward_mlp_sync_batch``
    after the forward), SGLang's DP gather / scatter around every MLP / MoE.
    Changed for CPU tensors, after import: ``_dp_attention_on_cpu`` (SGLang's own
    CPU branches where the line has them). The row-parallel stand-ins shard over
    the group of the replaced module's own projection (attention: its attention-TP
    group, one rank per DP rank; dense MLP / MoE: the TP group); with an
    all-to-all MoE backend (``moe_a2a_backend="deepep"``, DeepEP itself stubbed)
    the sparse layers' MoE is the whole-row ``StandIn``: DeepEP's dispatch and
    combine map this rank's rows to their outputs.

Not covered
    TBO, PP, CUDA graphs, the CUDA / AMX fused norm kernels, the
    flashinfer / aiter all-reduce + RMSNorm fusion (it needs TP > 1 and
    sm90/sm100 + flashinfer or ROCm aiter, so it is never taken here), custom /
    symmetric-memory / NCCL all-reduce (TP > 1 runs gloo on CPU).

Per-version surface (from ``SURFACE``, smoke runs)
    ==========  =====================  ======================  =================
    version     decoder layer          aux to LogitsProcessor  capture point
    ==========  =====================  ======================  =================
    0.5.9       LayerCommunicator      list of K [T, H]        model loop:
                                                               hidden + residual
    0.5.13      LayerCommunicator      list of K [T, H]        model loop:
                                                               hidden + residual
    0.5.18      LayerCommunicator      packed [T, K*H]         communicator
                                       (AuxHiddenStatePacker)  prepare_attn_and_
                                                               capture_last_...
    0.5.20      LayerCommunicator      packed [T, K*H]         same
    0.5.22      attn_boundary          packed [T, K*H]         StageBoundary.
                (StageBoundary; plan.                          _prepare_attention
                norm is input_layernorm)                       capture_gathered
    0.5.23      attn_boundary          packed [T, K*H]         same
    ==========  =====================  ======================  =================

    ``layer.input_layernorm is layer.layer_communicator.input_layernorm`` (<=
    0.5.20) and ``layer.attn_boundary.plan.norm is layer.input_layernorm``
    (0.5.22, 0.5.23): True in every version. set_eagle3_layers_to_capture:
    0.5.9 always adds 1 to the ids; >= 0.5.13 adds 1 only when ids[0] == 1.
    0.5.13 cannot capture layer 0 (``hidden_states + residual`` with residual
    None: TypeError); >= 0.5.18 can.

VERIFIED (``python tests/sglang_real/smoke.py VERSION``: T = 0 (IDLE), 1, 5;
extend and decode; bf16 and fp32; aux == hidden + residual at the captured
layers' input bit for bit, and == an independent pure-torch recomputation;
final hidden states == the recomputation; every norm ran forward_native):
0.5.9, 0.5.13, 0.5.18, 0.5.20, 0.5.22, 0.5.23 all PASS on torch 2.13.0+cpu,
python 3.11 (see ``VERIFIED``).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import types
from typing import Any, NamedTuple

# Pure torch paths only: never take SGLang's CPU-engine (AMX / sgl_kernel CPU
# ops) branch, even if the environment says so.
os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
os.environ.setdefault("SGLANG_IS_FLASHINFER_AVAILABLE", "false")

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.sglang_real import stubs  # noqa: E402

# Hugging Face's kernels package is in the test venv (transformers >= 5.25 there depends
# on it) but in no SGLang line's own environment; the older transformers each line pins
# imports it when present and fails on its newer API. Hidden from these processes
# (importlib.util.find_spec answers None for a name mapped to None).
sys.modules.setdefault("kernels", None)

# Version-specific extra stubs (names whose absence breaks that version's
# module-level imports).
EXTRA_STUBS = {
    "0.5.17": ("xgrammar",),
    "0.5.18": ("xgrammar",),
    "0.5.20": ("xgrammar",),
    "0.5.22": ("xgrammar",),
    "0.5.23": ("xgrammar", "tvm_ffi"),
}

# smoke.py results on this machine (torch 2.13.0+cpu, python 3.11, 2 cores).
VERIFIED = {
    "0.5.9": "PASS (transformers 4.57.1, huggingface_hub <1, tokenizers <=0.23.0)",
    "0.5.13": "PASS (transformers 5.8.1)",
    "0.5.18": "PASS (transformers 5.12.1; xgrammar stubbed)",
    "0.5.20": "PASS (transformers 5.12.1; xgrammar stubbed)",
    "0.5.22": "PASS (transformers 5.19.0; xgrammar stubbed)",
    "0.5.23": "PASS (transformers 5.19.0; xgrammar, tvm_ffi stubbed)",
}

_STATE: dict = {}


def _detect_version_from_path() -> str:
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None:
        raise RuntimeError("sglang not importable: put the overlay on PYTHONPATH")
    root = os.path.dirname(os.path.dirname(spec.origin))
    for name in os.listdir(root):
        if name.startswith("sglang-") and name.endswith(".dist-info"):
            return name[len("sglang-") : -len(".dist-info")]
    raise RuntimeError(f"no sglang dist-info next to {spec.origin}")


def sglang_version() -> str:
    return _STATE.get("version") or _detect_version_from_path()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------- set-up


def _ensure_stubs():
    """Install the GPU-only stubs before anything imports transformers or
    sglang (transformers caches package availability at import time)."""
    # torchada (MUSA) only so that is_musa()'s try-import does not break a dynamo
    # trace (an import that fails is unsupported there); is_musa() stays False,
    # as torch.version has no musa.
    stubs.install(("torchada",) + tuple(EXTRA_STUBS.get(_detect_version_from_path(), ())))


def use_overlay(version_dir: str) -> None:
    """Put an overlay made by tools/sglang_real_env.sh first on sys.path.
    Must run before anything imports sglang or transformers."""
    version_dir = os.path.abspath(version_dir)
    for mod in ("sglang", "transformers"):
        m = sys.modules.get(mod)
        if m is not None and not os.path.abspath(m.__file__).startswith(version_dir + os.sep):
            raise RuntimeError(
                f"{mod} already imported from {m.__file__}; one sglang version per "
                "process: start a new process with the overlay on PYTHONPATH"
            )
    if version_dir not in sys.path:
        sys.path.insert(0, version_dir)


def setup(
    version: str | None = None,
    dtype=None,
    hf_config=None,
    version_dir=None,
    *,
    tp_size: int | None = None,
    rank: int = 0,
    init_method: str | None = None,
    dist_timeout: int | None = None,
    dp_size: int = 1,
    moe_a2a_backend: str | None = None,
    moe_dense_tp_size: int | None = None,
):
    """Import sglang (stubs installed first), set global server args and the
    gloo process groups. Idempotent (first call wins).

    Default: world 1, TP 1 (a free local port). ``tp_size > 1``: this process is
    TP rank ``rank`` of a world of ``tp_size`` processes that all call setup()
    with the same ``init_method`` (``tcp://127.0.0.1:<port>``, required): the
    ServerArgs get ``tp_size``, 0.5.22+ publish ``SpawnRanks(world_rank=rank)``
    (what run_scheduler_process computes with spawn_world_rank at PP 1), and
    init_distributed_environment / initialize_model_parallel run at that world
    size (see the "Tensor parallel" section of the module docstring).
    ``dist_timeout``: seconds, passed to init_distributed_environment (as the
    model runner passes --dist-timeout) so that a rank whose peer died fails
    instead of waiting the default 30 minutes. ``dp_size > 1``: DP attention
    (``--enable-dp-attention --dp-size dp_size``; see "DP attention" in the
    module docstring)."""
    if _STATE.get("ready"):
        if tp_size is not None and (tp_size, rank) != (_STATE["tp_size"], _STATE["rank"]):
            raise RuntimeError(
                f"harness already set up at TP {_STATE['tp_size']} rank {_STATE['rank']}; "
                f"asked for TP {tp_size} rank {rank}: one world per process"
            )
        return
    tp_size = 1 if tp_size is None else tp_size
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is not in a TP world of {tp_size}")
    if tp_size > 1 and init_method is None:
        raise ValueError(
            "tp_size > 1 needs the init_method all ranks share (tcp://127.0.0.1:<port>)"
        )
    if dp_size < 1 or tp_size % dp_size:
        raise ValueError(f"dp_size {dp_size} does not divide tp_size {tp_size}")
    if version_dir is not None:
        use_overlay(version_dir)
    import torch

    version = version or _detect_version_from_path()
    _ensure_stubs()
    real = _detect_version_from_path()
    if real != version:
        raise RuntimeError(f"asked for sglang {version}, the path has {real}")
    _STATE["version"] = version
    if hf_config is None:
        hf_config = make_config()

    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    # TP > 1: --disable-custom-all-reduce, as SGLang's own warning asks of a CPU
    # process (there is no custom all-reduce on CPU; the gloo all-reduce runs).
    args = {} if tp_size == 1 else dict(tp_size=tp_size, disable_custom_all_reduce=True)
    if dp_size > 1:
        args.update(dp_size=dp_size, enable_dp_attention=True)
    if moe_dense_tp_size is not None:
        args["moe_dense_tp_size"] = moe_dense_tp_size
    syncs = dp_size > 1 or moe_a2a_backend is not None or moe_dense_tp_size is not None
    if syncs:  # the forwards sync their DP / MoE rows
        try:  # 0.5.20+: model_path "dummy" skips the resolution that fills it in
            from sglang.srt.model_executor.cuda_graph_config import (
                Backend,
                CudaGraphConfig,
                PhaseConfig,
            )

            args["cuda_graph_config"] = CudaGraphConfig(
                decode=PhaseConfig(backend=Backend.DISABLED),
                prefill=PhaseConfig(backend=Backend.DISABLED),
            )
        except ImportError:
            pass
    if moe_a2a_backend is not None:
        # Its GPU package (DeepEP) stubbed: the MoE body is stood in, only the
        # layer layout SGLang derives from the backend is real.
        stubs.install(("deep_ep",))
        args["moe_a2a_backend"] = moe_a2a_backend
    server_args = ServerArgs(model_path="dummy", device="cpu", **args)
    try:
        from sglang.srt.runtime_context import SpawnRanks, publish
    except ImportError:
        SpawnRanks = None
    if SpawnRanks is not None:
        # 0.5.23: the legacy shim publishes no rank placement, and
        # initialize_dp_attention then fails on get_parallel().tp_rank; do
        # what run_scheduler_process does (world rank 0, no DP controller,
        # no device).
        # At TP > 1: run_scheduler_process's spawn_world_rank(server_args,
        # tp_rank, pp_rank=0) = tp_rank (no EP join offset).
        world_rank = rank
        if tp_size > 1:
            from sglang.srt.runtime_context import spawn_world_rank

            world_rank = spawn_world_rank(server_args, tp_rank=rank, pp_rank=0)
        # DP attention: the DP controller gives TP rank r the attention-DP rank
        # r // attn_tp_size (compute_dp_attention_world_info).
        dp_rank = rank // (tp_size // dp_size) if dp_size > 1 else None
        publish(
            server_args,
            role="scheduler",
            ranks=SpawnRanks(world_rank=world_rank, dp_rank=dp_rank, gpu_id=None),
        )
        publish_call = f"runtime_context.publish(role='scheduler', ranks=SpawnRanks({world_rank}))"
    else:
        # <= 0.5.13: sets the module global read by get_global_server_args();
        # 0.5.18 - 0.5.22: a shim for runtime_context.publish(server_args,
        # role="scheduler"), which resolves the args and projects the
        # get_exec()/get_parallel()/... bags.
        set_global_server_args_for_scheduler(server_args)
        publish_call = "set_global_server_args_for_scheduler"
    _STATE["server_args"] = server_args

    import inspect

    from sglang.srt.distributed import parallel_state as ps

    extra = {}
    if tp_size > 1:  # what the model runner calls before init_distributed_environment
        ps.set_custom_all_reduce(not server_args.disable_custom_all_reduce)
    if (
        dist_timeout is not None
        and "timeout" in inspect.signature(ps.init_distributed_environment).parameters
    ):
        extra["timeout"] = dist_timeout
    ps.init_distributed_environment(
        world_size=tp_size,
        rank=rank,
        local_rank=rank,
        distributed_init_method=init_method or f"tcp://127.0.0.1:{_free_port()}",
        backend="gloo",
        **extra,
    )

    calls = [
        publish_call,
        f"init_distributed_environment(gloo, world {tp_size}"
        + (f", rank {rank})" if tp_size > 1 else ")"),
    ]
    if "tensor_model_parallel_size" in inspect.signature(ps.initialize_model_parallel).parameters:
        dp_kw = {"attention_data_parallel_size": dp_size} if dp_size > 1 else {}
        ps.initialize_model_parallel(tensor_model_parallel_size=tp_size, **dp_kw)  # <= 0.5.22
        calls.append(
            f"initialize_model_parallel(tensor_model_parallel_size={tp_size}"
            + (f", attention_data_parallel_size={dp_size})" if dp_kw else ")")
        )
    else:  # 0.5.23: widths come from the published get_parallel() (tp_size=server_args.tp_size)
        ps.initialize_model_parallel()
        calls.append("initialize_model_parallel()")

    # What initialize_dp_attention / init_dp_gathered_buffer /
    # initialize_layernorm_sp read of ModelConfig: hidden_size, dtype,
    # hf_config (architectures, hybrid_override_pattern).
    model_config = types.SimpleNamespace(
        hidden_size=hf_config.hidden_size,
        dtype=dtype or torch.float32,
        hf_config=hf_config,
    )
    from sglang.srt.layers import dp_attention

    if "model_config" in inspect.signature(dp_attention.initialize_dp_attention).parameters:
        dp_attention.initialize_dp_attention(server_args=server_args, model_config=model_config)
        calls.append("initialize_dp_attention(server_args, model_config)")
    else:  # 0.5.23
        dp_attention.initialize_dp_attention(server_args=server_args)
        calls.append("initialize_dp_attention(server_args)")
    try:  # 0.5.23: bootstrap.init_layer_runtime = init_dp_gathered_buffer + layernorm SP
        from sglang.srt.distributed.bootstrap import init_layer_runtime
    except ImportError:
        init_layer_runtime = None
    if init_layer_runtime is not None:
        init_layer_runtime(model_config=model_config)
        calls.append("bootstrap.init_layer_runtime(model_config)")
    else:
        try:  # 0.5.20 / 0.5.22 (bootstrap._init_parallel_groups calls it next)
            from sglang.srt.layers.layernorm_sp import initialize_layernorm_sp
        except ImportError:
            initialize_layernorm_sp = None
        if initialize_layernorm_sp is not None:
            initialize_layernorm_sp(model_config=model_config)
            calls.append("initialize_layernorm_sp(model_config)")
    _STATE["init_calls"] = calls
    try:  # the scheduler calls it before building the model runner
        from sglang.srt.layers.moe.utils import initialize_moe_config
    except ImportError:
        initialize_moe_config = None
    if initialize_moe_config is not None:
        if inspect.signature(initialize_moe_config).parameters:  # <= 0.5.13
            initialize_moe_config(server_args)
            calls.append("initialize_moe_config(server_args)")
        else:  # >= 0.5.20: reads the published bags
            initialize_moe_config()
            calls.append("initialize_moe_config()")
    if syncs:  # DP gathers / scattered rows
        calls += _dp_attention_on_cpu()
    _STATE["tp_size"] = tp_size
    _STATE["dp_size"] = dp_size
    _STATE["rank"] = rank
    _STATE["ready"] = True


def _dp_attention_on_cpu() -> list[str]:
    """What DP attention's forward needs to run on CPU tensors, each SGLang's own
    CPU branch where the line has one (module globals, set after import; the
    computation is unchanged): pinned memory in ``prepare_mlp_sync_batch``
    (``forward_batch_info._is_cpu``; <= 0.5.18 have no CPU branch: pinning is
    dropped by a TorchFunctionMode around that call, :func:`make_dp_batch`), the
    Triton row copy of dp_gather / dp_scatter (``dp_attention.memcpy_cpu``, or a
    torch slice copy of the same semantics where the line has none), and the
    CUDA-only custom ops ``GroupCoordinator.all_gather_into_tensor`` /
    ``reduce_scatter_tensor`` wrap (their own ``_``-prefixed bodies, which the
    custom ops call, then ``torch.distributed`` on gloo). SGLANG_USE_CPU_ENGINE
    stays unset, so RMSNorm still takes forward_native."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers import dp_attention as dpa
    from sglang.srt.model_executor import forward_batch_info as fbi

    done = []
    coordinator = ps.GroupCoordinator
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        setattr(coordinator, name, getattr(coordinator, "_" + name))
        done.append(f"GroupCoordinator.{name} = GroupCoordinator._{name}")
    if hasattr(dpa, "memcpy_cpu"):
        dpa.memcpy_func = dpa.memcpy_cpu
        done.append("dp_attention.memcpy_func = dp_attention.memcpy_cpu")
    else:

        def memcpy_torch(dst, src, dim, offset, sz, offset_src):
            """memcpy_triton's semantics: rows [offset, offset + sz) of src into dst's
            first rows (offset_src), or src's first rows into dst at offset."""
            if dim != 0 or src.shape[1:] != dst.shape[1:]:
                raise AssertionError("memcpy_triton stand-in: rows of equal width only")
            o, n = int(offset), int(sz)
            if offset_src:
                dst[:n].copy_(src[o : o + n])
            else:
                dst[o : o + n].copy_(src[:n])

        dpa.memcpy_triton = memcpy_torch
        done.append("dp_attention.memcpy_triton = a torch row copy")
    if hasattr(fbi, "_is_cpu"):
        fbi._is_cpu = True
        done.append("forward_batch_info._is_cpu = True")
    return done


def tp_world_size() -> int:
    """The TP world this process was set up with (1 before setup)."""
    return _STATE.get("tp_size", 1)


def tp_rank() -> int:
    return _STATE.get("rank", 0)


# -------------------------------------------------------------- stand-ins


def _define_modules():
    import torch
    from torch import nn

    class StandIn(nn.Module):
        """Deterministic stand-in for attention / MLP / MoE: accepts the real
        call's arguments, returns ``0.5 * tanh(h @ W^T)`` (fp32 math).

        Only ``forward`` is stood in: any other attribute the decoder layer
        reads of its ``self_attn`` / ``mlp`` (e.g. the context manager
        ``self_attn.maybe_use_decode_attn_tp(forward_batch)`` of >= 0.5.20)
        is looked up on the real, replaced module and runs as SGLang's code.
        ``isinstance(layer.mlp, DeepseekV2MoE / DeepseekV2MLP)`` is False, so
        the layer's MoE-only branches (moe_output_buffer_ctx) are not taken."""

        def __init__(self, hidden_size: int, seed: int, role: str, real=None):
            super().__init__()
            g = torch.Generator().manual_seed(seed)
            w = torch.randn(hidden_size, hidden_size, generator=g) / hidden_size**0.5
            self.register_buffer("w", w)
            self.role = role
            self.calls = 0
            # Not a submodule (kept out of named_modules / state_dict).
            object.__setattr__(self, "_real", real)

        def __getattr__(self, name):
            try:
                return super().__getattr__(name)
            except AttributeError:
                real = self.__dict__.get("_real")
                if real is None:
                    raise
                return getattr(real, name)

        def forward(self, *args, **kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            if isinstance(h, tuple):  # never expected on this path
                raise TypeError(f"{self.role}: hidden_states is a tuple")
            self.calls += 1
            out = 0.5 * torch.tanh(h.float() @ self.w.t())
            return out.to(h.dtype)

    class RowParallelStandIn(StandIn):
        """Tensor-parallel stand-in for attention / MLP / MoE: a row-parallel
        partial on each rank, reduced by SGLang's own code.

        ``y = 0.5 * tanh(h) @ W^T`` (W seeded as :class:`StandIn`'s), computed
        as the real modules compute their output projection: the elementwise
        activation, this rank's block of input columns ``cols_r`` (what a
        column-parallel up projection would hand it), then SGLang's own
        ``RowParallelLinear(H, H, bias=False, reduce_results=...)``, whose
        weight is loaded from the full W by SGLang's own ``weight_loader``
        (rank r keeps ``W[:, cols_r]``). So rank r returns
        ``partial_r = act(h)[:, cols_r] @ W[:, cols_r]^T`` and only the sum over
        ranks is the layer's output; at TP 1 it is that output.

        ``reduces``: whether the replaced real module reduces its own output,
        read from it (:func:`_reduces_itself`): then the RowParallelLinear
        all-reduces (SGLang's ``tensor_model_parallel_all_reduce``), honouring
        the skip flags the real module honours (<= 0.5.13: the layer's
        ``should_allreduce_fusion`` / ``use_reduce_scatter`` arguments, passed
        as ``skip_all_reduce``; >= 0.5.18: ``RowParallelLinear`` reads the
        ``get_forward()`` flags itself). Otherwise it returns the partial and
        the layer's communicator / stage boundary must reduce it."""

        def __init__(self, hidden_size: int, seed: int, role: str, real, reduces: bool):
            super().__init__(hidden_size, seed, role, real)
            from sglang.srt.layers.linear import RowParallelLinear

            world, rank, group = _shard_group(real)
            if hidden_size % world:
                raise ValueError(f"hidden {hidden_size} does not split over {world} ranks")
            shard = hidden_size // world
            self.cols = (rank * shard, (rank + 1) * shard)
            self.reduces = bool(reduces)
            self.proj = RowParallelLinear(
                hidden_size,
                hidden_size,
                bias=False,
                reduce_results=self.reduces,
                prefix=f"standin.{role}.proj",
                **group,
            )
            self.proj.weight_loader(self.proj.weight, self.w.to(self.proj.weight.dtype))
            want = self.w[:, self.cols[0] : self.cols[1]].to(self.proj.weight.dtype)
            if not torch.equal(self.proj.weight.data, want):
                raise AssertionError(
                    f"{role}: SGLang's RowParallelLinear weight_loader did not "
                    f"keep input columns {self.cols} of W on rank {rank}"
                )
            try:
                import inspect

                self._real_sig = inspect.signature(type(real).forward)
            except (TypeError, ValueError):
                self._real_sig = None
            self.skips = 0  # forwards where the layer asked this module not to reduce

        def _skip_requested(self, args, kwargs) -> bool:
            """<= 0.5.13's explicit skip arguments of the real MLP / MoE forward."""
            if self._real_sig is None:
                return False
            try:
                bound = self._real_sig.bind_partial(None, *args, **kwargs).arguments
            except TypeError:
                return False
            return bool(bound.get("should_allreduce_fusion")) or bool(
                bound.get("use_reduce_scatter")
            )

        def forward(self, *args, **kwargs):
            h = kwargs.get("hidden_states", args[0] if args else None)
            if isinstance(h, tuple):  # never expected on this path
                raise TypeError(f"{self.role}: hidden_states is a tuple")
            self.calls += 1
            act = (0.5 * torch.tanh(h.float())).to(h.dtype)
            local = act[:, self.cols[0] : self.cols[1]].contiguous()
            skip = self._skip_requested(args, kwargs)
            self.skips += skip
            out, _ = self.proj(local, skip_all_reduce=True) if skip else self.proj(local)
            return out

    return StandIn, RowParallelStandIn


class LogitsCall(NamedTuple):
    """One call of the model's LogitsProcessor: its inputs exactly as the model
    handed them, and SGLang's own ``LogitsProcessorOutput`` for them."""

    hidden_states: Any
    aux_hidden_states: Any
    output: Any


def _observed_logits_processor(config):
    """SGLang's own ``LogitsProcessor`` for ``config``, run unchanged; each call's
    inputs and output are kept in ``records`` (LogitsCall) for the scenarios: the
    aux the model hands over (a list <= 0.5.13, a packed tensor from 0.5.18) goes
    through the wheel's own contract, and what the draft receives is the output's
    ``hidden_states``."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    class ObservedLogitsProcessor(LogitsProcessor):
        def forward(
            self,
            input_ids,
            hidden_states,
            lm_head,
            logits_metadata,
            aux_hidden_states=None,
            *args,
            **kwargs,
        ):
            output = super().forward(
                input_ids,
                hidden_states,
                lm_head,
                logits_metadata,
                aux_hidden_states,
                *args,
                **kwargs,
            )
            self.records.append(LogitsCall(hidden_states, aux_hidden_states, output))
            return output

    lp = ObservedLogitsProcessor(config)
    lp.records = []
    return lp


def _all_to_all_moe(real) -> bool:
    """A sparse layer's MoE under an all-to-all backend (DeepEP): it dispatches
    each of this rank's rows to its experts and combines them back, so it maps
    this rank's rows to their finished outputs with no collective the layer
    sees; its stand-in is the whole contraction (``StandIn``) on those rows."""
    if type(real).__name__ != "DeepseekV2MoE":
        return False
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend

    return not get_moe_a2a_backend().is_none()


def _shard_group(real) -> tuple[int, int, dict]:
    """(ranks, this rank, RowParallelLinear arguments) of the group the replaced
    real module's output projection shards over: attention's ``o_proj`` (the
    attention-TP group: one rank per DP rank under DP attention), the dense
    MLP's ``down_proj``, else (the MoE) the TP group. The arguments are empty
    where that group is the TP group (RowParallelLinear's default)."""
    from sglang.srt.distributed import get_tp_group

    tp = get_tp_group()
    proj = getattr(real, "o_proj", None) or getattr(real, "down_proj", None)
    if proj is None:
        return tp.world_size, tp.rank_in_group, {}
    if hasattr(proj, "tp_rank"):  # <= 0.5.20: tp_rank / tp_size arguments
        world, rank = proj.tp_size, proj.tp_rank
        group = {"tp_rank": rank, "tp_size": world}
    else:  # 0.5.22+: a parallel_group argument
        from sglang.srt.layers import linear

        world = proj.input_size // proj.input_size_per_partition
        rank = linear.get_group_rank_size(proj.tp_group)[0] if world > 1 else 0
        group = {"parallel_group": proj.parallel_group}
    if (world, rank) == (tp.world_size, tp.rank_in_group):
        return world, rank, {}
    return world, rank, group


def _reduces_itself(role: str, real) -> bool:
    """Whether SGLang's real ``self_attn`` / ``mlp`` module all-reduces its own
    output at TP > 1 (else the communicator / stage boundary does):

    * attention: its ``o_proj`` (RowParallelLinear) is built with
      ``reduce_results=False`` by the decoder layer in every line (0.5.9 -
      0.5.23): the communicator's ``prepare_mlp`` (<= 0.5.20) or the
      ``ffn_boundary`` (>= 0.5.22) reduces;
    * dense MLP: ``down_proj.reduce_results`` (True <= 0.5.20; the layer passes
      False from 0.5.22, the stage boundary sums);
    * MoE: ``DeepseekV2MoE.reduce_results`` where it has one (0.5.22+: False),
      else True (<= 0.5.20 it calls tensor_model_parallel_all_reduce itself
      when tp_size > 1)."""
    if role == "attn":
        return bool(real.o_proj.reduce_results)
    down = getattr(real, "down_proj", None)
    if down is not None and hasattr(down, "reduce_results"):
        return bool(down.reduce_results)
    return bool(getattr(real, "reduce_results", True))


# ---------------------------------------------------------------- model


def make_config(
    num_layers: int = 6,
    hidden_size: int = 64,
    vocab_size: int = 128,
    first_k_dense_replace: int = 2,
):
    _ensure_stubs()
    from eagle_capture.testing.models import tiny_deepseek_v3_config

    return tiny_deepseek_v3_config(num_layers, hidden_size, vocab_size, first_k_dense_replace)


# Gemma's norms scale by (1 + weight) and are not RMSNorm subclasses.
GEMMA_NORMS = ("GemmaRMSNorm", "Gemma3RMSNorm")


def _norms(model):
    from sglang.srt.layers.layernorm import RMSNorm

    return [
        (n, m)
        for n, m in model.named_modules()
        if isinstance(m, RMSNorm) or type(m).__name__ in GEMMA_NORMS
    ]


# Model classes the harness builds (SGLang's own; the text model inside is
# DeepseekV2's in each): the architectures a DeepSeek-V3 / Kimi-K2 / Kimi-K2.5
# checkpoint names.
ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration")


def text_lm(model):
    """The DeepseekV2 causal LM inside ``model`` (Kimi-K2.5: ``language_model``)."""
    return getattr(model, "language_model", None) or model


def _kimi_k25_config(text_cfg):
    """A tiny KimiK25Config around ``text_cfg`` (vision tower of one small layer;
    the fields SGLang's KimiK25ForConditionalGeneration reads at construction)."""
    from sglang.srt.configs.kimi_k25 import KimiK25Config

    vision = dict(
        vt_hidden_size=16,
        patch_size=2,
        init_pos_emb_height=4,
        init_pos_emb_width=4,
        init_pos_emb_time=2,
        num_attention_heads=2,
        num_hidden_layers=1,
        hidden_size=16,
        intermediate_size=32,
        mm_hidden_size=16,
        text_hidden_size=text_cfg.hidden_size,
    )
    cfg = KimiK25Config(text_config=text_cfg.to_dict(), vision_config=vision)
    cfg.architectures = ["KimiK25ForConditionalGeneration"]
    cfg.encoder_only = False  # what KimiK25Config.__init__ of the checkpoint's remote
    cfg.language_only = False  # code sets; SGLang's own class reads them
    return cfg


def build_model(
    num_layers: int = 6,
    hidden_size: int = 64,
    dtype=None,
    capture_ids=(1, 3, 4),
    seed: int = 0,
    arch: str = "DeepseekV2ForCausalLM",
    set_capture: bool = True,
    standin: str | None = None,
):
    """SGLang's own ``arch`` class (one of :data:`ARCHS`), stand-ins installed,
    deterministic weights, ``set_eagle3_layers_to_capture(capture_ids)`` called
    unless ``set_capture`` is False (the plugin's hook path calls SGLang's own
    configure step, which does).

    ``standin``: ``"tanh"`` (:class:`StandIn`, the default at TP 1) or
    ``"row_parallel"`` (:class:`RowParallelStandIn`, the default and the only
    choice at TP > 1: a per-rank partial that SGLang's own code reduces). At
    TP > 1 the vocab-sharded embedding is loaded from the full table with
    SGLang's own ``weight_loader``, so every TP world gets the same weights."""
    import torch

    dtype = dtype or torch.float32
    cfg = make_config(num_layers=num_layers, hidden_size=hidden_size)
    setup(dtype=dtype, hf_config=cfg)
    world = tp_world_size()
    standin = standin or ("tanh" if world == 1 else "row_parallel")
    if standin not in ("tanh", "row_parallel"):
        raise ValueError(f"standin {standin!r}: expected 'tanh' or 'row_parallel'")
    if standin == "tanh" and world > 1:
        raise ValueError(
            "the 'tanh' stand-in computes the full output on every rank, which "
            "SGLang's all-reduce would then add up tp_size times: use "
            "standin='row_parallel' at TP > 1"
        )
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.models import deepseek_v2

    StandIn, RowParallelStandIn = _define_modules()
    torch.manual_seed(seed)
    with set_default_torch_dtype(dtype), torch.device("cpu"):
        if arch == "KimiK25ForConditionalGeneration":
            from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration

            model = KimiK25ForConditionalGeneration(_kimi_k25_config(cfg), quant_config=None)
        else:
            model = getattr(deepseek_v2, arch)(cfg, quant_config=None)
    model.eval()
    lm = text_lm(model)

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        emb = lm.model.embed_tokens.weight
        if world == 1:
            emb.copy_(torch.randn(emb.shape, generator=g).to(emb.dtype))
        else:  # this rank's vocab shard of the table TP 1 draws (same generator)
            embed = lm.model.embed_tokens
            full = torch.randn((embed.num_embeddings_padded, emb.shape[1]), generator=g)
            embed.weight_loader(emb, full[: embed.org_vocab_size].to(emb.dtype))
        for _, norm in _norms(lm):
            w = norm.weight
            w.copy_((1.0 + 0.1 * torch.randn(w.shape, generator=g)).to(w.dtype))

    for i, layer in enumerate(lm.model.layers):
        if standin == "tanh":
            layer.self_attn = StandIn(hidden_size, seed * 1000 + 2 * i, "attn", layer.self_attn)
            layer.mlp = StandIn(hidden_size, seed * 1000 + 2 * i + 1, "mlp", layer.mlp)
        else:
            with set_default_torch_dtype(dtype):
                layer.self_attn = RowParallelStandIn(
                    hidden_size,
                    seed * 1000 + 2 * i,
                    "attn",
                    layer.self_attn,
                    _reduces_itself("attn", layer.self_attn),
                )
                if _all_to_all_moe(layer.mlp):  # whole rows in, whole rows out
                    layer.mlp = StandIn(hidden_size, seed * 1000 + 2 * i + 1, "mlp", layer.mlp)
                else:
                    layer.mlp = RowParallelStandIn(
                        hidden_size,
                        seed * 1000 + 2 * i + 1,
                        "mlp",
                        layer.mlp,
                        _reduces_itself("mlp", layer.mlp),
                    )
    lm.logits_processor = _observed_logits_processor(lm.config)
    _seed_lm_head(lm, seed)
    if set_capture:
        model.set_eagle3_layers_to_capture(list(capture_ids))
    model._harness_dtype = dtype
    return model


def _seed_lm_head(lm, seed: int) -> None:
    """N(0, 1) lm_head weights; at TP > 1 this rank's vocab shard of the table TP 1
    draws, through the head's own ``weight_loader``."""
    import torch

    head = lm.lm_head
    if head is lm.model.embed_tokens:  # tied: already seeded with the embedding
        return
    g = torch.Generator().manual_seed(seed + 101)
    w = head.weight
    with torch.no_grad():
        if tp_world_size() == 1:
            w.copy_(torch.randn(w.shape, generator=g).to(w.dtype))
        else:
            full = torch.randn((head.num_embeddings_padded, w.shape[1]), generator=g)
            head.weight_loader(w, full[: head.org_vocab_size].to(w.dtype))


def make_batch(model, num_tokens: int, mode: str = "extend", seed: int = 0, capture: str = "full"):
    """(input_ids, positions, forward_batch) for an EXTEND (one request of
    ``num_tokens`` new tokens, no prefix) or DECODE (``num_tokens`` requests
    of one token) batch. ``num_tokens == 0`` gives an IDLE batch. ``capture``:
    the batch's CaptureHiddenMode, "full" as an EAGLE-3 target's forwards run
    (the LogitsProcessor then hands the draft every row's aux), or "last"."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import (
        CaptureHiddenMode,
        ForwardBatch,
        ForwardMode,
    )

    hidden_mode = {"full": CaptureHiddenMode.FULL, "last": CaptureHiddenMode.LAST}[capture]

    vocab = text_lm(model).config.vocab_size
    g = torch.Generator().manual_seed(seed + 17)
    input_ids = torch.randint(0, vocab, (num_tokens,), generator=g, dtype=torch.int64)
    i32 = dict(dtype=torch.int32)
    if num_tokens == 0:
        fm = ForwardMode.IDLE
        bs = 0
        seq_lens = torch.zeros(0, **i32)
        positions = torch.zeros(0, dtype=torch.int64)
        extra = {}
    elif mode == "extend":
        fm = ForwardMode.EXTEND
        bs = 1
        seq_lens = torch.tensor([num_tokens], **i32)
        positions = torch.arange(num_tokens, dtype=torch.int64)
        extra = dict(
            extend_num_tokens=num_tokens,
            extend_seq_lens=torch.tensor([num_tokens], **i32),
            extend_prefix_lens=torch.zeros(1, **i32),
            extend_start_loc=torch.zeros(1, **i32),
            extend_seq_lens_cpu=[num_tokens],
            extend_prefix_lens_cpu=[0],
        )
    elif mode == "decode":
        fm = ForwardMode.DECODE
        bs = num_tokens
        seq_lens = torch.arange(3, 3 + num_tokens, **i32)
        positions = (seq_lens - 1).to(torch.int64)
        extra = {}
    else:
        raise ValueError(mode)
    fb = ForwardBatch(
        forward_mode=fm,
        batch_size=bs,
        input_ids=input_ids,
        req_pool_indices=torch.arange(bs, **i32),
        seq_lens=seq_lens,
        out_cache_loc=torch.arange(num_tokens, dtype=torch.int64),
        seq_lens_sum=int(seq_lens.sum()),
        seq_lens_cpu=seq_lens.clone(),
        positions=positions,
        **extra,
    )
    fb.capture_hidden_mode = hidden_mode
    return input_ids, positions, fb


def make_dp_batch(
    model, num_tokens: int, mode: str = "extend", seed: int = 0, capture: str = "full"
):
    """Under DP attention (or an all-to-all MoE: any server whose forwards sync
    their rows): this rank's own batch (``make_batch``) plus what the scheduler
    and model runner add before the forward -- the token counts of every DP rank
    (one entry per attention-DP group), all-gathered over the TP group's CPU group as the scheduler's
    DP-attention sync does (``global_num_tokens``, ``..._for_logprob``,
    ``is_extend_in_batch``), then SGLang's own
    ``ForwardBatch.prepare_mlp_sync_batch`` (the padding mode, the DP buffer
    lengths, this rank's rows padded) with a stand-in model runner carrying the
    fields it reads. ``run`` then calls ``post_forward_mlp_sync_batch``, which
    trims the output back to this rank's rows. A collective: every rank calls it."""
    import torch
    import torch.distributed as dist
    from sglang.srt.distributed import get_tp_group

    input_ids, positions, fb = make_batch(model, num_tokens, mode, seed, capture)
    logprob_rows = num_tokens if mode == "decode" else min(num_tokens, 1)
    mine = torch.tensor([num_tokens, logprob_rows, int(mode == "extend" and num_tokens > 0)])
    group = get_tp_group()
    every = [torch.empty_like(mine) for _ in range(group.world_size)]
    dist.all_gather(every, mine, group=group.cpu_group)
    every = every[:: group.world_size // _STATE.get("dp_size", 1)]  # one per DP rank
    tokens = [int(t[0]) for t in every]
    logprob = [int(t[1]) for t in every]
    fb.is_extend_in_batch = any(int(t[2]) for t in every)
    fb.global_num_tokens_cpu = tokens
    fb.global_num_tokens_gpu = torch.tensor(tokens, dtype=torch.int64)
    fb.global_num_tokens_for_logprob_cpu = logprob
    fb.global_num_tokens_for_logprob_gpu = torch.tensor(logprob, dtype=torch.int64)
    if hasattr(fb, "original_global_num_tokens_cpu"):
        fb.original_global_num_tokens_cpu = tokens
    if getattr(fb, "lora_ids", "absent") is None:  # ForwardBatch.init_new sets one per request
        fb.lora_ids = [None] * fb.batch_size
    with _no_pinned_memory():
        fb.prepare_mlp_sync_batch(_dp_runner(model))
    fb._harness_dp = True
    return fb.input_ids, fb.positions, fb


def _dp_runner(model):
    """The model-runner fields ``prepare_mlp_sync_batch`` reads (every line read):
    not a draft worker, the model config, the server arguments (0.5.18), the
    attention backend's seq-len fill
    value for padded requests (1, as the CPU and CUDA backends return) and, in
    0.5.23, its late-layer row count (None: the backends without late layers)."""
    import types

    lm = text_lm(model)

    class Backend:
        def get_cuda_graph_seq_len_fill_value(self):
            return 1

        def get_cpu_graph_seq_len_fill_value(self):
            return 1

        def late_layer_num_tokens(self, forward_batch):  # 0.5.23: no late-layer rows
            return None

    config = types.SimpleNamespace(
        hidden_size=lm.config.hidden_size,
        hf_config=lm.config,
        dtype=model._harness_dtype,
        linear_attn_registry_result=None,
    )
    runner = types.SimpleNamespace(
        is_draft_worker=False,
        model_config=config,
        attn_backend=Backend(),
        spec_algorithm=None,
        server_args=_STATE["server_args"],
    )
    from sglang.srt.model_executor.model_runner import ModelRunner

    if hasattr(ModelRunner, "attn_tp_sequence_sharded"):  # 0.5.23
        runner.attn_tp_sequence_sharded = lambda n: ModelRunner.attn_tp_sequence_sharded(runner, n)
    return runner


def _no_pinned_memory():
    """<= 0.5.18 pin the DP token counts unconditionally (no CPU branch): the same
    tensors, unpinned (pinning needs an accelerator)."""
    import contextlib

    from sglang.srt.model_executor import forward_batch_info as fbi

    if hasattr(fbi, "_is_cpu"):
        return contextlib.nullcontext()
    from torch.overrides import TorchFunctionMode

    class NoPin(TorchFunctionMode):
        def __torch_function__(self, func, types_, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
            return func(*args, **kwargs)

    return NoPin()


def run(model, batch) -> LogitsCall:
    """One forward: what the model handed its (real) LogitsProcessor and what that
    returned (a DP-attention batch: after SGLang's post_forward_mlp_sync_batch)."""
    import torch

    input_ids, positions, fb = batch
    rec = text_lm(model).logits_processor
    n = len(rec.records)
    with torch.no_grad():
        returned = model.forward(input_ids, positions, fb)
    assert len(rec.records) == n + 1, "LogitsProcessor not called exactly once"
    call = rec.records[-1]
    assert returned is call.output, "the model did not return its LogitsProcessor's output"
    if getattr(fb, "_harness_dp", False):
        fb.post_forward_mlp_sync_batch(call.output)
    return call


def draft_input(call: LogitsCall):
    """What the EAGLE-3 draft receives from this forward: the LogitsProcessor
    output's ``hidden_states`` (SGLang's own concatenation / packing of the aux,
    all rows in FULL mode, the sampled rows in LAST mode); None when the model
    handed no aux (SGLang then stores the final hidden states instead)."""
    if call.aux_hidden_states is None:
        return None
    return call.output.hidden_states


# ---------------------------------------------------------------- surface


def surface(model) -> dict:
    import inspect

    from sglang.srt.layers.layernorm import RMSNorm

    layer = model.model.layers[0]
    s = {"version": sglang_version()}
    comm = getattr(layer, "layer_communicator", None)
    s["layer_communicator"] = type(comm).__name__ if comm is not None else None
    if comm is not None:
        s["input_layernorm_is_communicator_norm"] = (
            getattr(comm, "input_layernorm", None) is layer.input_layernorm
        )
    boundary = getattr(layer, "attn_boundary", None)
    s["attn_boundary"] = type(boundary).__name__ if boundary is not None else None
    if boundary is not None:
        plan = getattr(boundary, "plan", None)
        s["attn_boundary_plan"] = type(plan).__name__ if plan is not None else None
        norm = getattr(plan, "norm", None) if plan is not None else None
        s["attn_boundary_plan_norm_is_input_layernorm"] = norm is getattr(
            layer, "input_layernorm", object()
        )
    ffn = getattr(layer, "ffn_boundary", None)
    if ffn is not None and getattr(ffn, "plan", None) is not None:
        s["ffn_boundary_plan_norm_is_post_attention_layernorm"] = getattr(
            ffn.plan, "norm", None
        ) is getattr(layer, "post_attention_layernorm", object())
    s["has_input_layernorm_attr"] = hasattr(layer, "input_layernorm")
    s["decoder_forward_params"] = list(inspect.signature(type(layer).forward).parameters)[1:]
    try:
        from sglang.srt.layers import aux_hidden_states as ahs

        packer = getattr(ahs, "AuxHiddenStatePacker", None)
        s["packer"] = f"{packer.__module__}.{packer.__qualname__}" if packer else None
        if packer is not None:
            s["packer_methods"] = sorted(
                n
                for n, v in vars(packer).items()
                if not n.startswith("__") and callable(getattr(packer, n, None))
            )
    except ImportError:
        s["packer"] = None
    norm = layer.input_layernorm if hasattr(layer, "input_layernorm") else None
    if isinstance(norm, RMSNorm):
        # <= 0.5.18: MultiPlatformOp resolves _forward_method in __init__;
        # >= 0.5.20: BaseFusedOp resolves it lazily on the first call.
        # 0.5.23 dropped dispatch_forward(); _resolve_forward_method() is
        # what BaseFusedOp.forward calls when _forward_method is None.
        resolve = getattr(norm, "dispatch_forward", None) or norm._resolve_forward_method
        fm = resolve()
        s["rmsnorm_dispatch"] = getattr(fm, "__name__", repr(fm))
        s["rmsnorm_class_mro"] = [c.__name__ for c in type(norm).__mro__[:3]]
        s["rmsnorm_has_forward_with_allreduce_fusion"] = hasattr(
            norm, "forward_with_allreduce_fusion"
        )
    s["layers_to_capture"] = list(model.model.layers_to_capture)
    s["init_calls"] = list(_STATE.get("init_calls", []))
    s["capture_aux_hidden_states"] = getattr(model, "capture_aux_hidden_states", None)
    s["model_forward_params"] = list(inspect.signature(type(model.model).forward).parameters)[1:]
    return s


SURFACE: dict = {}


def build(num_layers=6, hidden=64, dtype=None, seed=0, capture_ids=(1, 3, 4), *, version_dir=None):
    """build_model + fill SURFACE. ``version_dir``: an overlay dir to put on
    sys.path first (only before sglang is imported)."""
    if version_dir is not None:
        setup(
            dtype=dtype,
            version_dir=version_dir,
            hf_config=make_config(num_layers=num_layers, hidden_size=hidden),
        )
    model = build_model(num_layers, hidden, dtype, capture_ids, seed)
    SURFACE.clear()
    SURFACE.update(surface(model))
    return model


def main(argv=None):
    import json

    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--version", default=None)
    ap.add_argument("--tokens", type=int, default=5)
    ap.add_argument("--mode", default="extend")
    ap.add_argument(
        "--version-dir", default=None, help="overlay dir (else it must already be on PYTHONPATH)"
    )
    args = ap.parse_args(argv)
    setup(args.version, version_dir=args.version_dir)
    model = build(dtype=torch.float32)
    print(json.dumps(SURFACE, indent=1, default=str))
    hs, aux = run(model, make_batch(model, args.tokens, args.mode))
    print(
        "final",
        tuple(hs.shape),
        "aux",
        [tuple(a.shape) for a in aux]
        if isinstance(aux, (list, tuple))
        else getattr(aux, "shape", aux),
    )


if __name__ == "__main__":
    main()
