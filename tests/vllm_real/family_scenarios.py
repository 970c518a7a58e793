"""The vLLM plugin's fused capture on the other EAGLE-3 families, in vLLM's own
model code (family_models.py says what is real); run inside scenarios.py
(``family_<name>``, ``family_compiled_<name>``, ``family_pipeline``; the TP 2 ones
through ``--rank``). The reference is always vLLM's own class with the same
weights, its own capture."""

from __future__ import annotations

import os
import types

import torch

from tests.vllm_real import family_models as fm
from tests.vllm_real import harness as h

# Captured ids per case (8 layers): vLLM's defaults (2, 4, 5), the embedding and the
# final boundary, one layer, unsorted, every boundary.
IDS = [(2, 4, 5), (0, 4, 8), (3,), (6, 1, 3), tuple(range(9))]
TOKENS = (1, 7, 33)
# Built in CI: every family fp32 eager; compiled and TP 2 for one dense, one MoE.
EAGER = tuple(fm.FAMILIES)
COMPILED = ("qwen3_moe",)  # a dense family compiled: Llama at TP 2 in allreduce_fusion
TP2 = ("llama", "qwen3_moe")


def scenario_names() -> list[str]:
    """scenarios.py's names of these (the tp2 ones run under --rank)."""
    from tests.vllm_real import hf_tensor

    return (
        [f"family_{f}" for f in EAGER]
        + [f"family_compiled_{f}" for f in COMPILED]
        + ["family_pipeline"]
        + [f"family_hf_tensor_{f}" for f in hf_tensor.FAMILIES]
    )


def _folder(work: str, family: str, dtype: str = "float32") -> str:
    return fm.write_config(os.path.join(work, f"family_{family}_{dtype}"), family, dtype)


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
        runs.append(
            {
                "tokens": n,
                "count": len(o[1]),
                "expected": len(r[1]),
                "equal": len(r[1]) == len(o[1])
                and all(torch.equal(a, b) for a, b in zip(r[1], o[1])),
                "hidden_equal": torch.equal(r[0], o[0]),
                "views_of_buffer": state is not None
                and all(h.in_buffer(v, state.buffer) for v in o[1]),
            }
        )
    return {
        "ids": list(ids),
        "installed": state is not None,
        "vllm_capture_off": list(om.model.aux_hidden_state_layers) == [],
        "fused_calls": state.fused_calls if state else 0,
        "slot_residual_calls": state.slot_residual_calls if state else 0,
        "runs": runs,
    }


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
    return {
        "type": type(ours[0]).__module__ + "." + type(ours[0]).__name__,
        "vllm_type": type(ref[0]).__module__ + "." + type(ref[0]).__name__,
        "cases": cases,
        "on_lines": on_lines,
        "verified": verified,
        "self_check_lines": [m for m in log_lines if "self-check" in m],
    }


def compiled(family: str, work: str) -> dict:
    """Under vLLM's own torch.compile (Inductor, fullgraph): the capture is the
    project's op in the generated code, equal to vLLM's own compiled capture."""
    h.use_cache_root(os.path.join(work, "vllm_cache"))
    ref, ours = fm.load_pair(family, _folder(work, family), compiled=True)
    case = _compare(ref, ours, (0, 4, 8), (7, 33, 5))
    calls = h.op_calls_in_inductor_code(ours[0].model.compilation_config.local_cache_dir)
    return {
        "case": case,
        "compiled": ours[0]._eagle_capture.compiled,
        "python_calls": ours[0]._eagle_capture.fused_calls,
        "op_calls_in_inductor_code": calls,
    }


def tp2(family: str, work: str) -> dict:
    ref, ours = fm.load_pair(family, _folder(work, family), tp=2)
    case = _compare(ref, ours, (0, 4, 8), (9,))
    tok = h.tokens(9, 9)
    captures = h.forward(ours[0], ours[1], tok)[1]
    return {"type": type(ours[0]).__name__, "case": case, "captures": [t.clone() for t in captures]}


def pipeline(work: str) -> dict:
    """Two pipeline stages (vLLM's group stood in: this CPU run has one process):
    what each family's rule does on each stage."""
    from eagle_capture.integrations.vllm import install as vllm_install
    from eagle_capture.integrations.vllm import model as plugin_model

    class Stage:
        world_size = 2

        def __init__(self, last):
            self.is_last_rank, self.is_first_rank = last, not last

    out = {}
    real = vllm_install.get_pp_group
    for family in ("llama", "qwen3_moe", "minimax_m2"):
        ref, ours = fm.load_pair(family, _folder(work, family))
        model = ours[0]
        for last in (False, True):
            vllm_install.get_pp_group = lambda last=last: Stage(last)
            try:
                model.set_aux_hidden_state_layers((2, 4, 5))
                status = "fused" if model._eagle_capture is not None else "vllm's own"
            except plugin_model.WrongCaptureLayers as e:
                status = f"refused: {e}"
            finally:
                vllm_install.get_pp_group = real
            out[f"{family} {'last' if last else 'first'} stage"] = status
    return out


# ---- vLLM's all-reduce + RMSNorm fusion pass at the captured layers (TP 2) ----


def _vllm_fusion_module():
    """vLLM's ``compilation/passes/fusion/allreduce_rms_fusion.py``. Its imports name
    CUDA-only ``torch.ops._C`` quant ops (dict keys of other patterns); on CPU those
    names resolve to placeholders during the import only."""
    import importlib

    real = torch.ops._C

    class Names:
        def __getattr__(self, name):
            try:
                return getattr(real, name)
            except AttributeError:
                return type("Missing", (), {"__getattr__": lambda s, k: f"_C.{name}.{k}"})()

    torch.ops._C = Names()
    try:
        return importlib.import_module("vllm.compilation.passes.fusion.allreduce_rms_fusion")
    finally:
        torch.ops._C = real


def _as_default_overload(graph) -> None:
    """vLLM's pre-grad ``VllmIRInplaceFunctionalizationPass`` turns its IR ops'
    ``maybe_inplace`` calls into the functional default overload before AOTAutograd
    (what its fusion passes see on CUDA); in this CPU compile the graph reaches the
    post-grad passes with them auto-functionalized instead. The same rewrite, on a
    copy: ``auto_functionalized(op.maybe_inplace, **args)`` whose users take only
    the op's returned values -> ``op.default(*args)``."""
    import operator

    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    for node in list(graph.nodes):
        if node.target is not auto_functionalized:
            continue
        op = node.args[0]
        if getattr(op, "_overloadname", None) != "maybe_inplace":
            continue
        default = op.overloadpacket.default
        returns = len(default._schema.returns)
        if not all(u.target is operator.getitem and u.args[1] < returns for u in node.users):
            continue
        schema = default._schema.arguments
        args = [node.kwargs[a.name] for a in schema if a.name in node.kwargs]
        # Trailing arguments equal to their defaults dropped, as torch's dispatcher
        # hands an op's arguments to a Python trace (how AOTAutograd records it).
        while (
            args
            and schema[len(args) - 1].has_default_value()
            and args[-1] == schema[len(args) - 1].default_value
        ):
            args.pop()
        with graph.inserting_before(node):
            call = graph.call_function(default, tuple(args))
        node.replace_all_uses_with(call)
        graph.erase_node(node)


def _counting_pass(dtype):
    """An Inductor pass (vLLM's post-grad hook, where its AllReduceFusionPass runs on
    CUDA) that counts where vLLM's own ``AllReduceFusedAddRMSNormPattern`` (the
    all_reduce -> fused_add_rms_norm match that pass registers, for both its eps)
    matches, on a copy of the graph (_as_default_overload). The pattern's
    replacement (FlashInfer's fused kernel, CUDA only) is swapped for the pattern
    itself: the count is what the pass would fuse."""
    import copy

    from torch._inductor import pattern_matcher as pm
    from vllm.compilation.passes.inductor_pass import InductorPass

    fusion = _vllm_fusion_module()
    patterns = pm.PatternMatcherPass(pass_name="eagle_capture_allreduce_rms_count")
    real = pm.register_replacement

    def same_graph(search_fn, replace_fn, *args, **kwargs):
        return real(search_fn, search_fn, *args, **kwargs)

    pm.register_replacement = same_graph
    try:
        for eps in (1e-5, 1e-6):
            fusion.AllReduceFusedAddRMSNormPattern(eps, dtype, "cpu", None).register(patterns)
    finally:
        pm.register_replacement = real

    class CountAllReduceRMSNorm(InductorPass):
        matches = 0
        norms = 0

        def __call__(self, graph):
            module = copy.deepcopy(graph.owning_module)
            _as_default_overload(module.graph)
            type(self).norms += sum(
                "fused_add_rms_norm" in str(n.target) for n in module.graph.nodes
            )
            type(self).matches += patterns.apply(module.graph)

        def uuid(self):
            return "eagle-capture-count-allreduce-rms"

    return CountAllReduceRMSNorm()


def _compiled_tp2_llama(work, keep, counter=None):
    """vLLM's own Llama (keep None) or the plugin's with keeps_allreduce_fusion
    answering ``keep``, compiled at TP 2, ids (2, 4, 8): (model, its config)."""
    from eagle_capture.integrations.vllm import install as vllm_install
    from eagle_capture.integrations.vllm.checked import vllm_class

    vc = fm.engine_config(_folder(work, "llama"), tp=2, compiled=True)
    if counter is not None:
        vc.compilation_config.inductor_compile_config["post_grad_custom_post_pass"] = counter
    model = h.load(vc, vllm_class("LlamaForCausalLM") if keep is None else None)
    fm.fill(model)
    fm.stand_in(model, "llama")
    real = vllm_install.keeps_allreduce_fusion
    vllm_install.keeps_allreduce_fusion = lambda config, compiled: keep
    try:
        model.set_aux_hidden_state_layers((2, 4, 8))
    finally:
        vllm_install.keeps_allreduce_fusion = real
    return model, vc


def allreduce_fusion(work: str, rank: int) -> dict:
    """Llama at TP 2 under vLLM's compile, ids (2, 4, 8). On the graph vLLM's compile
    hands its post-grad passes, vLLM's own all-reduce + RMSNorm pattern matches at
    every all-reduce -> norm site of the plugin's model with the capture after
    vLLM's norm (what keeps_allreduce_fusion picks where vLLM runs that pass); in
    vLLM's own model its capture (``hidden_states + residual``, a second reader of
    the all-reduce) and in ours with the capture inside the project's norm op, the
    captured layers do not match. Then that placement's captures and output
    against vLLM's own, compiled at TP 2."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from vllm.distributed import get_tp_group

    # Every model compiled here (no vLLM or Inductor cache hit): the passes run.
    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    h.use_cache_root(os.path.join(work, f"vllm_cache_fusion_{rank}"))
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    tok = h.tokens(9, 9)
    out = {}
    # vLLM's CUDA platform traces the TP all-reduce as torch.ops.vllm.all_reduce
    # (use_custom_op_collectives), which the pattern names; its CPU platform calls its
    # shared-memory op directly. As on CUDA for the count (the CPU communicator reduces
    # in place under that out-of-place op: no numbers are compared in this part).
    # That in-place reduce returns its input, which torch's first-call aliasing check of
    # custom ops rejects where it is an error (the default when the CI variable is set):
    # the check is off for this part only.
    group = get_tp_group()
    custom_op_call, group.use_custom_op_call = group.use_custom_op_call, True
    aliasing_check = functorch_config.check_custom_op_aliasing
    functorch_config.check_custom_op_aliasing = False
    try:
        # (Our op at the captured layers instead, the placement where vLLM runs no such
        # pass, matches 13 here too: the mutant "the capture inside our op where vLLM
        # fuses all-reduce + RMSNorm" in tools/mutation_check.py shows it.)
        for name, keep in (("vllm", None), ("ours_fusion_kept", True)):
            counter = _counting_pass(torch.float32)
            model, vc = _compiled_tp2_llama(work, keep, counter)
            h.forward(model, vc, tok)
            state = getattr(model, "_eagle_capture", None)
            out[name] = {
                "matches": type(counter).matches,
                "norms": type(counter).norms,
                "keep": state.keep_allreduce_fusion if state else None,
                "additional": (vc.additional_config or {}).get("eagle_capture"),
            }
    finally:
        group.use_custom_op_call = custom_op_call
        functorch_config.check_custom_op_aliasing = aliasing_check
    # When the plugin picks that placement: vLLM's pass_config flag, compiled, TP > 1.
    from eagle_capture.integrations.vllm import install as vllm_install

    def config(flag):
        return types.SimpleNamespace(
            compilation_config=types.SimpleNamespace(
                pass_config=types.SimpleNamespace(fuse_allreduce_rms=flag)
            )
        )

    out["decision"] = {
        "flag_compiled": vllm_install.keeps_allreduce_fusion(config(True), True),
        "flag_eager": vllm_install.keeps_allreduce_fusion(config(True), False),
        "no_flag": vllm_install.keeps_allreduce_fusion(config(False), True),
        "flag_unset": vllm_install.keeps_allreduce_fusion(config(None), True),
    }
    # The placement's numbers, on vLLM's CPU all-reduce.
    (ref, ref_vc), (ours, vc) = (_compiled_tp2_llama(work, None), _compiled_tp2_llama(work, True))
    r, o = h.forward(ref, ref_vc, tok), h.forward(ours, vc, tok)
    out["ours_fusion_kept"]["equal"] = (
        len(o[1]) == len(r[1]) == 3
        and all(torch.equal(a, b) for a, b in zip(r[1], o[1]))
        and torch.equal(r[0], o[0])
    )
    return out
