"""The vLLM plugin's fused capture on the other EAGLE-3 families, in vLLM's own
model code (family_models.py says what is real); run inside scenarios.py
(``family_<name>``, ``family_compiled_<name>``, ``family_pipeline``; the TP 2 ones
through ``--rank``). The reference is always vLLM's own class with the same
weights, its own capture."""

from __future__ import annotations

import os

import torch

from tests.vllm_real import family_models as fm
from tests.vllm_real import harness as h

# Captured ids per case (8 layers): vLLM's defaults (2, 4, 5), the embedding and the
# final boundary, one layer, unsorted, every boundary.
IDS = [(2, 4, 5), (0, 4, 8), (3,), (6, 1, 3), tuple(range(9))]
TOKENS = (1, 7, 33)
# Built in CI: every family fp32 eager; compiled and TP 2 for one dense, one MoE.
EAGER = tuple(fm.FAMILIES)
COMPILED = ("llama", "qwen3_moe")
TP2 = ("llama", "qwen3_moe")


def scenario_names() -> list[str]:
    """scenarios.py's names of these (the tp2 ones run under --rank)."""
    return ([f"family_{f}" for f in EAGER] + [f"family_compiled_{f}" for f in COMPILED]
            + ["family_pipeline"])


def _folder(work: str, family: str, dtype: str = "float32") -> str:
    return fm.write_config(os.path.join(work, f"family_{family}_{dtype}"), family, dtype)


def _in_buffer(view, buffer) -> bool:
    start = buffer.aux.data_ptr()
    return start <= view.data_ptr() < start + buffer.aux.numel() * buffer.aux.element_size()


def _compare(ref, ours, ids, tokens) -> dict:
    (rm, rvc), (om, ovc) = ref, ours
    rm.set_aux_hidden_state_layers(ids)
    # Id 0 (the embedding) is a problem to the start-up check (no trainer's draft takes
    # it): served, as vLLM serves it, under EAGLE_CAPTURE_ON_PROBLEM=install.
    saved = os.environ.get("EAGLE_CAPTURE_ON_PROBLEM")
    if 0 in ids:
        os.environ["EAGLE_CAPTURE_ON_PROBLEM"] = "install"
    try:
        om.set_aux_hidden_state_layers(ids)
    finally:
        if saved is None:
            os.environ.pop("EAGLE_CAPTURE_ON_PROBLEM", None)
        else:
            os.environ["EAGLE_CAPTURE_ON_PROBLEM"] = saved
    state = om._eagle_capture
    runs = []
    for n in tokens:
        tok = h.tokens(n, n)
        r, o = h.forward(rm, rvc, tok), h.forward(om, ovc, tok)
        runs.append({"tokens": n, "count": len(o[1]), "expected": len(r[1]),
                     "equal": len(r[1]) == len(o[1]) and all(
                         torch.equal(a, b) for a, b in zip(r[1], o[1])),
                     "hidden_equal": torch.equal(r[0], o[0]),
                     "views_of_buffer": state is not None and all(
                         _in_buffer(v, state.buffer) for v in o[1])})
    return {"ids": list(ids), "installed": state is not None,
            "vllm_capture_off": list(om.model.aux_hidden_state_layers) == [],
            "fused_calls": state.fused_calls if state else 0,
            "slot_residual_calls": state.slot_residual_calls if state else 0, "runs": runs}


def eager(family: str, work: str, log_lines: list) -> dict:
    """fp32, vLLM's own class vs the plugin's, bit-exact, for each id set."""
    ref, ours = fm.load_pair(family, _folder(work, family))
    del log_lines[:]
    cases = [_compare(ref, ours, ids, TOKENS) for ids in IDS]
    on_lines = [m for m in log_lines if "fused EAGLE-3 capture ON" in m]
    # The live self-check (EAGLE_CAPTURE_VERIFY), the embedding slot included.
    os.environ["EAGLE_CAPTURE_VERIFY"] = "2"
    try:
        del log_lines[:]
        verified = _compare(ref, ours, (0, 4, 8), (5, 9, 3))
    finally:
        del os.environ["EAGLE_CAPTURE_VERIFY"]
    return {"type": type(ours[0]).__module__ + "." + type(ours[0]).__name__,
            "vllm_type": type(ref[0]).__module__ + "." + type(ref[0]).__name__,
            "cases": cases, "on_lines": on_lines, "verified": verified,
            "self_check_lines": [m for m in log_lines if "self-check" in m]}


def compiled(family: str, work: str) -> dict:
    """Under vLLM's own torch.compile (Inductor, fullgraph): the capture is the
    project's op in the generated code, equal to vLLM's own compiled capture."""
    os.environ["VLLM_CACHE_ROOT"] = os.path.join(work, "vllm_cache")
    ref, ours = fm.load_pair(family, _folder(work, family), compiled=True)
    case = _compare(ref, ours, (0, 4, 8), (7, 33, 5))
    calls = 0
    for root, _, files in os.walk(ours[0].model.compilation_config.local_cache_dir or ""):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(root, f), errors="replace") as fh:
                    text = fh.read()
                if "def call(" in text:
                    calls += text.count("torch.ops.eagle_capture.")
    return {"case": case, "compiled": ours[0]._eagle_capture.compiled,
            "python_calls": ours[0]._eagle_capture.fused_calls,
            "op_calls_in_inductor_code": calls}


def tp2(family: str, work: str) -> dict:
    ref, ours = fm.load_pair(family, _folder(work, family), tp=2)
    case = _compare(ref, ours, (0, 4, 8), (9,))
    tok = h.tokens(9, 9)
    captures = h.forward(ours[0], ours[1], tok)[1]
    return {"type": type(ours[0]).__name__, "case": case,
            "captures": [t.clone() for t in captures]}


def pipeline(work: str) -> dict:
    """Two pipeline stages (vLLM's group stood in: this CPU run has one process):
    what each family's rule does on each stage."""
    from eagle_capture.integrations.vllm import model as plugin_model

    class Stage:
        world_size = 2

        def __init__(self, last):
            self.is_last_rank, self.is_first_rank = last, not last

    out = {}
    real = plugin_model.get_pp_group
    for family in ("llama", "qwen3_moe", "minimax_m2"):
        ref, ours = fm.load_pair(family, _folder(work, family))
        model = ours[0]
        for last in (False, True):
            plugin_model.get_pp_group = lambda last=last: Stage(last)
            try:
                model.set_aux_hidden_state_layers((2, 4, 5))
                status = "fused" if model._eagle_capture is not None else "vllm's own"
            except plugin_model.WrongCaptureLayers as e:
                status = f"refused: {e}"
            finally:
                plugin_model.get_pp_group = real
            out[f"{family} {'last' if last else 'first'} stage"] = status
    return out
