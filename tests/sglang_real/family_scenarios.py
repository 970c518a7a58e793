"""The fused capture on the other EAGLE-3 families, against the REAL SGLang code.

Each scenario builds one family's own SGLang model (``family_models.build``:
the wheel's ``<Model>ForCausalLM``, its decoder layers, communicator / stage
boundaries, RMSNorms, capture loop and LogitsProcessor; attention and MLP / MoE
stood in) twice from one seed: one runs SGLang's own EAGLE-3 capture, the other
gets ``install_eagle3_capture``. What the draft receives (the LogitsProcessor's
output) must be bit-identical in fp32.

    PYTHONPATH=$(tools/sglang_real_env.sh 0.5.23):. .venv/bin/python \\
        -m tests.sglang_real.family_scenarios --json out.json [--only NAME ...]
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from tests.sglang_real import family_models, harness, hf_tensor
from tests.sglang_real.scenarios import _run, compiled_same_as_sglang

NUM_LAYERS = 7
CAPTURE_IDS = (1, 3, 5)  # SpecForge ids: SGLang captures layers 2, 4, 6 in every family here
MAX_TOKENS = 16
FAMILIES = tuple(family_models.FAMILIES)


def _build(family, dtype=torch.float32, capture_ids=CAPTURE_IDS):
    return family_models.build(family, dtype=dtype, capture_ids=capture_ids, num_layers=NUM_LAYERS)


def _install(model, **kwargs):
    from eagle_capture.integrations.sglang.dropin import install_eagle3_capture

    return install_eagle3_capture(model, MAX_TOKENS, **kwargs)


def same_as_sglang(
    family: str, dtype_name: str = "float32", path: str = "f", capture_ids=CAPTURE_IDS
):
    """What the draft receives and the final hidden state, ours vs SGLang's own
    capture, over extend / decode / idle / LAST-mode batches."""
    dtype = getattr(torch, dtype_name)
    ref, ours = _build(family, dtype, capture_ids), _build(family, dtype, capture_ids)
    sglang_layers = sorted(ref.model.layers_to_capture)
    _install(ours, residual_in_slot=(path == "f"))
    state = ours._eagle_capture
    k = len(sglang_layers)
    hidden = ours.config.hidden_size
    # Path f where every captured norm has a post-attention norm after it.
    expect_f = path == "f" and NUM_LAYERS not in sglang_layers
    out = {
        "layers": sglang_layers,
        "surface": state.surface,
        "path_f": state.residual_in_slot_enabled,
        "packed_tensor": state.packed_tensor,
        "cases": [],
    }
    assert state.residual_in_slot_enabled == expect_f, (
        f"path f {'on' if state.residual_in_slot_enabled else 'off'}, expected {expect_f}"
    )
    for num_tokens, mode, capture in (
        (5, "extend", "full"),
        (1, "decode", "full"),
        (3, "decode", "full"),
        (11, "extend", "full"),
        (0, "extend", "full"),
        (6, "extend", "last"),
    ):
        fused_before = state.fused_calls
        final_ref, aux_ref = _run(ref, num_tokens, mode, seed=num_tokens, capture=capture)
        final, aux = _run(ours, num_tokens, mode, seed=num_tokens, capture=capture)
        rows = 1 if (mode, capture) == ("extend", "last") else num_tokens
        assert aux is not None and aux.shape == (rows, k * hidden), (
            f"{mode} T={num_tokens}: the draft receives {None if aux is None else tuple(aux.shape)}"
        )
        if num_tokens:
            assert aux_ref is not None and aux_ref.shape == aux.shape, (
                f"SGLang's own capture handed {None if aux_ref is None else tuple(aux_ref.shape)}"
            )
            assert torch.equal(aux, aux_ref), "aux differs from SGLang's own capture"
        if dtype == torch.float32 or num_tokens == 0:
            assert torch.equal(final, final_ref), "final hidden differs from SGLang's own"
        fused = state.fused_calls - fused_before
        if num_tokens:  # our kernel did every capture; SGLang's own capture is off
            assert fused + state.fallback_calls >= k and fused >= 1, f"{fused} fused captures"
        assert state.residual_in_slot is None, "a residual left in a slot was not taken"
        out["cases"].append({"T": num_tokens, "mode": mode, "capture": capture, "fused": fused})
    assert ours.model.layers_to_capture == [] and not ours.capture_aux_hidden_states
    assert not any(getattr(layer, "_is_layer_to_capture", False) for layer in ours.model.layers)
    out["fused_calls"], out["fallback_calls"] = state.fused_calls, state.fallback_calls
    return out


def compiled(family: str):
    """The layer loop traced by dynamo (fullgraph) through SGLang's own
    ``install_torch_compiled`` trampoline, as its piecewise CUDA graphs run it:
    ours vs SGLang's own, both compiled (scenarios.compiled_same_as_sglang)."""
    ref, ours = _build(family), _build(family)
    _install(ours)
    return compiled_same_as_sglang(ref, ours, f"{family} loop")


def final_boundary():
    """GPT-OSS ids ending at the number of layers: from 0.5.18 SGLang keeps them
    and captures the final norm's input; ours takes it from the final norm (path
    e there, path f off). 0.5.13 captures nothing there: refused at install."""
    from eagle_capture.integrations.sglang.dropin import WrongCaptureLayers, sglang_version

    if sglang_version() < (0, 5, 18):
        # Ids the line shifts onto the boundary (+1: layer N): its loop never captures
        # there, so the draft would get K - 1 states; refused.
        model = _build("gpt_oss", capture_ids=(1, 3, NUM_LAYERS - 1))
        assert sorted(model.model.layers_to_capture) == [2, 4, NUM_LAYERS]
        try:
            _install(model)
        except WrongCaptureLayers as e:
            assert f"capture layer(s) [{NUM_LAYERS}] of" in str(e), e
            assert f"outside 0..{NUM_LAYERS - 1}" in str(e), e
            return {"refused": str(e)[:200]}
        raise AssertionError("the final boundary installed on a line whose loop has none")
    result = same_as_sglang("gpt_oss", capture_ids=(1, 3, NUM_LAYERS))
    assert result["layers"] == [1, 3, NUM_LAYERS], result["layers"]
    assert not result["path_f"]
    return result


def switch_back(family: str = "qwen3_moe"):
    """The self-check's switch-back (a mismatch on a live server) turns the
    family's own capture back on: what the draft receives is SGLang's again."""
    ref, ours = _build(family), _build(family)
    _install(ours)
    state = ours._eagle_capture
    state.disable("test")
    final_ref, aux_ref = _run(ref, 5)
    final, aux = _run(ours, 5)
    assert aux is not None and torch.equal(aux, aux_ref), "switch-back: aux differs"
    assert state.fused_calls == 0
    flagged = [
        i
        for i, layer in enumerate(ours.model.layers)
        if getattr(layer, "_is_layer_to_capture", False)
    ]
    return {"layers_to_capture": list(ours.model.layers_to_capture), "marked": flagged}


def fp8_input_quant(family: str = "llama"):
    """Where SGLang's norm would fuse the next projection's static FP8 input
    quantization (0.5.20: the ``quant_linear`` argument; 0.5.23:
    ``fuse_input_quant``), the capturing norm runs SGLang's own code and stores
    the residual: our kernel writes no quantized output. The norm module's own
    test (``_fp8_static_input_scale``) is made to answer "static FP8" here."""
    import sglang.srt.layers.layernorm as layernorm

    if not hasattr(layernorm, "_fp8_static_input_scale"):
        return {"skip": f"SGLang {harness.sglang_version()} fuses no input quant into its norm"}
    ref, ours = _build(family), _build(family)
    _install(ours)
    state = ours._eagle_capture
    real = layernorm._fp8_static_input_scale
    layernorm._fp8_static_input_scale = lambda linear: torch.ones(1)
    try:
        final_ref, aux_ref = _run(ref, 5)
        final, aux = _run(ours, 5)
    finally:
        layernorm._fp8_static_input_scale = real
    assert torch.equal(aux, aux_ref) and torch.equal(final, final_ref)
    assert state.fused_calls == 0 and state.fallback_calls == len(CAPTURE_IDS), (
        f"{state.fused_calls} fused, {state.fallback_calls} through SGLang's norm"
    )
    _run(ours, 5)  # the real test again: a plain norm, our kernel
    assert state.fused_calls == len(CAPTURE_IDS)
    return {"fallback_calls": len(CAPTURE_IDS)}


def refusals():
    """What a family does differently is refused with the reason, SGLang's own
    capture left on; a class no adapter was read against is named."""
    from eagle_capture.integrations.sglang.dropin import UnsupportedServer
    from eagle_capture.integrations.sglang.families import UnknownFamily

    out = {}
    glm = _build("glm4_moe")
    glm.model.layers[4].attn_quant_format = "fp8_per_token"  # ROCm aiter's fused norm + quant
    try:
        _install(glm)
        raise AssertionError("GLM-4 MoE with aiter's fused norm + quant installed")
    except UnsupportedServer as e:
        assert "layers [4]" in str(e), e
        out["glm4_moe_aiter_fp8"] = str(e)
    assert glm.model.layers_to_capture and glm.capture_aux_hidden_states  # SGLang's stays
    llama = _build("llama")

    class SomeOtherForCausalLM(type(llama)):
        pass

    llama.__class__ = SomeOtherForCausalLM
    try:
        _install(llama)
        raise AssertionError("an unknown class installed")
    except UnknownFamily as e:
        assert "SomeOtherForCausalLM" in str(e), e
        out["unknown"] = str(e)
    return out


def draft_named_as_target() -> dict:
    """An EAGLE-3 draft in the original format names the target's architecture
    (``LlamaForCausalLM``): what SGLang's registry builds for that name, and whether it
    has the ``hot_token_id`` SGLang's EAGLE-3 worker reads of every draft (the engine
    facts' ``eagle3_draft_attribute``)."""
    from sglang.srt.models.registry import ModelRegistry

    cls, _ = ModelRegistry.resolve_model_cls(["LlamaForCausalLM"])
    model = family_models.build("llama", num_layers=1, set_capture=False)
    assert type(model) is cls, (type(model), cls)
    return {
        "class": f"{cls.__module__}.{cls.__name__}",
        "hot_token_id": hasattr(model, "hot_token_id"),
    }


SCENARIOS = {
    "draft_named_as_target": draft_named_as_target,
    "final_boundary": final_boundary,
    "switch_back": switch_back,
    "fp8_input_quant": fp8_input_quant,
    "refusals": refusals,
}
# Compiled: one family per way a layer calls its norms (itself: Llama <= 0.5.20;
# a communicator: Qwen3-MoE, with its per-layer marks; GPT-OSS's boundary loop).
COMPILED = ("llama", "qwen3_moe", "gpt_oss")
for _family in FAMILIES:
    SCENARIOS[f"{_family}_fp32_f"] = lambda f=_family: same_as_sglang(f, "float32", "f")
    SCENARIOS[f"{_family}_fp32_e"] = lambda f=_family: same_as_sglang(f, "float32", "e")
    SCENARIOS[f"{_family}_bf16_f"] = lambda f=_family: same_as_sglang(f, "bfloat16", "f")
    if _family in COMPILED:
        SCENARIOS[f"{_family}_compiled"] = lambda f=_family: compiled(f)


# Which tensor SGLang's capture holds, against transformers' hidden_states (hf_tensor.py).
for _family in hf_tensor.FAMILIES:
    SCENARIOS[f"hf_tensor_{_family}"] = lambda f=_family: hf_tensor.scenario(f)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--only", nargs="*")
    args = parser.parse_args()
    # One process per wheel: set up with a dense family's config (the MoE modules
    # the config would shape are stood in).
    harness.setup()
    results = {"version": harness.sglang_version()}
    for name, fn in SCENARIOS.items():
        if args.only and name not in args.only:
            continue
        started = time.perf_counter()
        try:
            results[name] = {"ok": True, **(fn() or {})}
        except Exception as e:  # noqa: BLE001 - reported per scenario
            results[name] = {
                "ok": False,
                "detail": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
        results[name]["seconds"] = round(time.perf_counter() - started, 2)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
