"""Run the REAL SGLang DeepseekV2 model code on CPU with EAGLE-3 capture on.

What this is
------------
A harness that imports SGLang's own wheel (one version per process: run each
version in its own subprocess), builds SGLang's own
``sglang.srt.models.deepseek_v2.DeepseekV2ForCausalLM`` from a tiny
``transformers.DeepseekV3Config`` (6 layers, hidden 64, vocab 128, q_lora_rank
48, kv_lora_rank 32, yarn rope with rope_theta, first_k_dense_replace 2, 4
routed experts) on CPU, turns EAGLE-3 capture on with the model's own
``set_eagle3_layers_to_capture(ids)``, runs the model's own ``forward`` and
returns what the model hands to its LogitsProcessor.

API: ``setup(version=None, dtype=None, hf_config=None, version_dir=None)``,
``build_model(num_layers, hidden_size, dtype, capture_ids, seed)``,
``make_batch(model, num_tokens, mode="extend"|"decode", seed=0)`` ->
(input_ids, positions, forward_batch), ``run(model, batch)`` ->
(final_hidden_states, aux) as passed to the LogitsProcessor,
``sglang_version()``, ``build(...)`` = build_model + ``SURFACE`` filled in.

Set-up (outside this file)::

    OVERLAY=$(scripts/sglang_real_env.sh 0.5.13)       # cached, idempotent
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
      ``ForwardMode`` (EXTEND, DECODE, IDLE for T = 0).
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
    * ``causal_lm.logits_processor``: a ``Recorder`` that stores and returns
      ``(hidden_states, aux_hidden_states)``, the output sink;
    * weights: not loaded; the embedding is N(0, 1), every RMSNorm weight is
      1 + 0.1 * N(0, 1) (so a wrong norm weight is visible). The real
      attention / MoE weights are never used.

Not covered
    TP > 1, DP attention, TBO, PP, CUDA graphs, the CUDA / AMX fused norm
    kernels, the flashinfer / aiter all-reduce + RMSNorm fusion (it needs
    TP > 1 and sm90/sm100 + flashinfer or ROCm aiter, so it is never taken
    here).

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

# Pure torch paths only: never take SGLang's CPU-engine (AMX / sgl_kernel CPU
# ops) branch, even if the environment says so.
os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
os.environ.setdefault("SGLANG_IS_FLASHINFER_AVAILABLE", "false")

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.sglang_real import stubs  # noqa: E402

# Version-specific extra stubs (names whose absence breaks that version's
# module-level imports).
EXTRA_STUBS = {
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
            return name[len("sglang-"): -len(".dist-info")]
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
    """Put an overlay made by scripts/sglang_real_env.sh first on sys.path.
    Must run before anything imports sglang or transformers."""
    version_dir = os.path.abspath(version_dir)
    for mod in ("sglang", "transformers"):
        m = sys.modules.get(mod)
        if m is not None and not os.path.abspath(m.__file__).startswith(version_dir + os.sep):
            raise RuntimeError(
                f"{mod} already imported from {m.__file__}; one sglang version per "
                "process: start a new process with the overlay on PYTHONPATH")
    if version_dir not in sys.path:
        sys.path.insert(0, version_dir)


def setup(version: str | None = None, dtype=None, hf_config=None, version_dir=None):
    """Import sglang (stubs installed first), set global server args and the
    TP=1 gloo process groups. Idempotent (first call wins)."""
    if _STATE.get("ready"):
        return
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

    server_args = ServerArgs(model_path="dummy", device="cpu")
    try:
        from sglang.srt.runtime_context import SpawnRanks, publish
    except ImportError:
        SpawnRanks = None
    if SpawnRanks is not None:
        # 0.5.23: the legacy shim publishes no rank placement, and
        # initialize_dp_attention then fails on get_parallel().tp_rank; do
        # what run_scheduler_process does (world rank 0, no DP controller,
        # no device).
        publish(server_args, role="scheduler",
                ranks=SpawnRanks(world_rank=0, dp_rank=None, gpu_id=None))
        publish_call = "runtime_context.publish(role='scheduler', ranks=SpawnRanks(0))"
    else:
        # <= 0.5.13: sets the module global read by get_global_server_args();
        # 0.5.18 - 0.5.22: a shim for runtime_context.publish(server_args,
        # role="scheduler"), which resolves the args and projects the
        # get_exec()/get_parallel()/... bags.
        set_global_server_args_for_scheduler(server_args)
        publish_call = "set_global_server_args_for_scheduler"
    _STATE["server_args"] = server_args

    from sglang.srt.distributed import parallel_state as ps

    ps.init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{_free_port()}",
        backend="gloo",
    )
    import inspect

    calls = [publish_call, "init_distributed_environment(gloo, world 1)"]
    if "tensor_model_parallel_size" in inspect.signature(ps.initialize_model_parallel).parameters:
        ps.initialize_model_parallel(tensor_model_parallel_size=1)  # <= 0.5.22
        calls.append("initialize_model_parallel(tensor_model_parallel_size=1)")
    else:  # 0.5.23: widths come from the published get_parallel() (tp_size=1)
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
    _STATE["ready"] = True


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

    class Recorder(nn.Module):
        """Stands for the LogitsProcessor: records its inputs, returns them."""

        def __init__(self):
            super().__init__()
            self.records = []

        def forward(self, input_ids, hidden_states, lm_head, forward_batch,
                    aux_hidden_states=None, *args, **kwargs):
            self.records.append((hidden_states, aux_hidden_states))
            return hidden_states, aux_hidden_states

    return StandIn, Recorder


# ---------------------------------------------------------------- model


def make_config(num_layers: int = 6, hidden_size: int = 64, vocab_size: int = 128,
                first_k_dense_replace: int = 2):
    _ensure_stubs()
    import transformers

    rope = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        moe_intermediate_size=hidden_size // 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=2.5,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=16,
        first_k_dense_replace=first_k_dense_replace,
        moe_layer_freq=1,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        architectures=["DeepseekV3ForCausalLM"],
        # As in DeepSeek-V3's config.json (SGLang's MoEGate reads them; the
        # transformers class does not define all of them).
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        norm_topk_prob=True,
    )
    major = int(transformers.__version__.split(".")[0])
    if major >= 5:
        cfg = transformers.DeepseekV3Config(
            rope_parameters=dict(rope, rope_theta=10000.0), **common
        )
    else:
        legacy = dict(rope)
        legacy["type"] = legacy.pop("rope_type")
        cfg = transformers.DeepseekV3Config(
            rope_theta=10000.0, rope_scaling=legacy, **common
        )
    return cfg


def _norms(model):
    from sglang.srt.layers.layernorm import RMSNorm

    return [(n, m) for n, m in model.named_modules() if isinstance(m, RMSNorm)]


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

    vision = dict(vt_hidden_size=16, patch_size=2, init_pos_emb_height=4, init_pos_emb_width=4,
                  init_pos_emb_time=2, num_attention_heads=2, num_hidden_layers=1,
                  hidden_size=16, intermediate_size=32, mm_hidden_size=16,
                  text_hidden_size=text_cfg.hidden_size)
    cfg = KimiK25Config(text_config=text_cfg.to_dict(), vision_config=vision)
    cfg.architectures = ["KimiK25ForConditionalGeneration"]
    cfg.encoder_only = False     # what KimiK25Config.__init__ of the checkpoint's remote
    cfg.language_only = False    # code sets; SGLang's own class reads them
    return cfg


def build_model(num_layers: int = 6, hidden_size: int = 64, dtype=None,
                capture_ids=(1, 3, 4), seed: int = 0, arch: str = "DeepseekV2ForCausalLM",
                set_capture: bool = True):
    """SGLang's own ``arch`` class (one of :data:`ARCHS`), stand-ins installed,
    deterministic weights, ``set_eagle3_layers_to_capture(capture_ids)`` called
    unless ``set_capture`` is False (the plugin's hook path calls SGLang's own
    configure step, which does)."""
    import torch

    dtype = dtype or torch.float32
    cfg = make_config(num_layers=num_layers, hidden_size=hidden_size)
    setup(dtype=dtype, hf_config=cfg)
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.models import deepseek_v2

    StandIn, Recorder = _define_modules()
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
        emb.copy_(torch.randn(emb.shape, generator=g).to(emb.dtype))
        for _, norm in _norms(lm):
            w = norm.weight
            w.copy_((1.0 + 0.1 * torch.randn(w.shape, generator=g)).to(w.dtype))

    for i, layer in enumerate(lm.model.layers):
        layer.self_attn = StandIn(hidden_size, seed * 1000 + 2 * i, "attn", layer.self_attn)
        layer.mlp = StandIn(hidden_size, seed * 1000 + 2 * i + 1, "mlp", layer.mlp)
    lm.logits_processor = Recorder()
    if set_capture:
        model.set_eagle3_layers_to_capture(list(capture_ids))
    model._harness_dtype = dtype
    return model


def make_batch(model, num_tokens: int, mode: str = "extend", seed: int = 0):
    """(input_ids, positions, forward_batch) for an EXTEND (one request of
    ``num_tokens`` new tokens, no prefix) or DECODE (``num_tokens`` requests
    of one token) batch. ``num_tokens == 0`` gives an IDLE batch."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

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
    return input_ids, positions, fb


def run(model, batch):
    """(final_hidden_states, aux) exactly as passed to the LogitsProcessor."""
    import torch

    input_ids, positions, fb = batch
    rec = text_lm(model).logits_processor
    n = len(rec.records)
    with torch.no_grad():
        model.forward(input_ids, positions, fb)
    assert len(rec.records) == n + 1, "LogitsProcessor not called exactly once"
    return rec.records[-1]


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
        s["attn_boundary_plan_norm_is_input_layernorm"] = (
            norm is getattr(layer, "input_layernorm", object())
        )
    ffn = getattr(layer, "ffn_boundary", None)
    if ffn is not None and getattr(ffn, "plan", None) is not None:
        s["ffn_boundary_plan_norm_is_post_attention_layernorm"] = (
            getattr(ffn.plan, "norm", None) is getattr(layer, "post_attention_layernorm", object())
        )
    s["has_input_layernorm_attr"] = hasattr(layer, "input_layernorm")
    s["decoder_forward_params"] = list(inspect.signature(type(layer).forward).parameters)[1:]
    try:
        from sglang.srt.layers import aux_hidden_states as ahs

        packer = getattr(ahs, "AuxHiddenStatePacker", None)
        s["packer"] = (
            f"{packer.__module__}.{packer.__qualname__}" if packer else None
        )
        if packer is not None:
            s["packer_methods"] = sorted(
                n for n, v in vars(packer).items()
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
    s["model_forward_params"] = list(
        inspect.signature(type(model.model).forward).parameters
    )[1:]
    return s


SURFACE: dict = {}


def build(num_layers=6, hidden=64, dtype=None, seed=0, capture_ids=(1, 3, 4), *,
          version_dir=None):
    """build_model + fill SURFACE. ``version_dir``: an overlay dir to put on
    sys.path first (only before sglang is imported)."""
    if version_dir is not None:
        setup(dtype=dtype, version_dir=version_dir,
              hf_config=make_config(num_layers=num_layers, hidden_size=hidden))
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
    ap.add_argument("--version-dir", default=None,
                    help="overlay dir (else it must already be on PYTHONPATH)")
    args = ap.parse_args(argv)
    setup(args.version, version_dir=args.version_dir)
    model = build(dtype=torch.float32)
    print(json.dumps(SURFACE, indent=1, default=str))
    hs, aux = run(model, make_batch(model, args.tokens, args.mode))
    print("final", tuple(hs.shape), "aux", [tuple(a.shape) for a in aux]
          if isinstance(aux, (list, tuple)) else getattr(aux, "shape", aux))


if __name__ == "__main__":
    main()
