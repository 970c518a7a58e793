"""``eagle_capture.integrations.sglang.dropin.install_eagle3_capture`` against the REAL SGLang code.

Run in a child process with one SGLang version's overlay first on the path
(``tests/test_sglang_real.py`` does that)::

    PYTHONPATH=$(tools/sglang_real_env.sh 0.5.13) .venv/bin/python -m tests.sglang_real.scenarios --json out.json

Each scenario builds SGLang's own ``DeepseekV2ForCausalLM`` (harness.py: real
layers, communicator / layer boundary, RMSNorm, capture loop; attention and MLP
stood in) twice from the same seed: one runs SGLang's own EAGLE-3 capture (the
reference), the other gets our install. Results go to a JSON file, one entry per
scenario: ``{"ok": bool, "detail": str, ...measurements}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
import traceback

import torch

from tests.sglang_real import harness, plugin_scenarios, stubs

NUM_LAYERS = 7
HIDDEN = 64
CAPTURE_IDS = (1, 3, 5)  # SpecForge ids: output of layers 1, 3, 5
MAX_TOKENS = 16


def _build(dtype, capture_ids=CAPTURE_IDS):
    return harness.build_model(
        num_layers=NUM_LAYERS, hidden_size=HIDDEN, dtype=dtype, capture_ids=capture_ids, seed=3
    )


def _run(model, num_tokens, mode="extend", seed=0, capture="full"):
    """(the final hidden states handed to SGLang's LogitsProcessor, what the draft
    receives from it: its output's hidden_states)."""
    call = harness.run(
        model, harness.make_batch(model, num_tokens, mode, seed=seed, capture=capture)
    )
    aux = harness.draft_input(call)
    return call.hidden_states.clone(), None if aux is None else aux.clone()


def _install(model, **kwargs):
    from eagle_capture.integrations.sglang.dropin import install_eagle3_capture

    return install_eagle3_capture(model, MAX_TOKENS, **kwargs)


def _state(model):
    return model._eagle_capture


def _expect_raises(exc_type, fn, match: str) -> str:
    try:
        fn()
    except exc_type as e:  # noqa: PERF203
        if match not in str(e):
            raise AssertionError(f"raised {exc_type.__name__} without {match!r}: {e}") from e
        return str(e)
    raise AssertionError(f"did not raise {exc_type.__name__} ({match!r})")


# ----------------------------------------------------------------- scenarios


def same_as_sglang(dtype_name: str, path: str = "f"):
    """Our buffer vs SGLang's own capture, and the final hidden state vs SGLang's
    own path, over extend / decode / idle batches and several sizes; ``path``
    "f" (the default install: the residual lives in the slot, the post-attention
    norm writes the next one out of place) or "e" (residual_in_slot=False: the
    residual updated in place and stored into the slot)."""
    dtype = getattr(torch, dtype_name)
    ref, ours = _build(dtype), _build(dtype)
    _install(ours, residual_in_slot=(path == "f"))
    state = _state(ours)
    out = {"cases": [], "max_final_abs_dev": 0.0, "max_aux_abs_dev": 0.0}
    # What the draft receives is SGLang's own LogitsProcessor output: every row in
    # FULL mode (an EAGLE-3 target's forwards), the sampled rows in LAST mode.
    for num_tokens, mode, capture in (
        (5, "extend", "full"),
        (1, "decode", "full"),
        (3, "decode", "full"),
        (11, "extend", "full"),
        (0, "extend", "full"),
        (6, "extend", "last"),
        (3, "decode", "last"),
    ):
        fused_before, in_slot_before = state.fused_calls, state.slot_residual_calls
        final_ref, aux_ref = _run(ref, num_tokens, mode, seed=num_tokens, capture=capture)
        final, aux = _run(ours, num_tokens, mode, seed=num_tokens, capture=capture)
        rows = 1 if (mode, capture) == ("extend", "last") else num_tokens
        assert aux is not None and aux.shape == (rows, len(CAPTURE_IDS) * HIDDEN), (
            f"{mode} {capture}: the draft receives {None if aux is None else tuple(aux.shape)}"
        )
        if num_tokens:
            assert aux_ref is not None and aux_ref.shape == aux.shape
            assert torch.equal(aux, aux_ref), "aux differs from SGLang's own capture"
        final_dev = (final.float() - final_ref.float()).abs().max().item() if num_tokens else 0.0
        if dtype == torch.float32:
            assert torch.equal(final, final_ref), f"final hidden differs by {final_dev}"
        out["max_final_abs_dev"] = max(out["max_final_abs_dev"], final_dev)
        fused = state.fused_calls - fused_before
        # Proof that our kernel did the capture: one fused call per captured layer
        # (zero-row batches skip the norm in SGLang), and SGLang captured nothing.
        if num_tokens:
            assert fused == len(CAPTURE_IDS), f"{fused} fused captures, want {len(CAPTURE_IDS)}"
        in_slot = state.slot_residual_calls - in_slot_before
        assert in_slot == (fused if path == "f" else 0), f"{in_slot} residuals left in a slot"
        assert state.residual_in_slot is None, "a residual left in a slot was not taken"
        assert state.fallback_calls == 0, f"{state.fallback_calls} fallback captures"
        assert ours.model.layers_to_capture == [] and not ours.capture_aux_hidden_states
        out["cases"].append(
            {
                "T": num_tokens,
                "mode": mode,
                "capture": capture,
                "fused_captures": fused,
                "final_abs_dev": final_dev,
            }
        )
    out["final_scale"] = final_ref.float().abs().max().item() if final_ref.numel() else None
    return out


@torch.no_grad()  # as SGLang's model runner calls the model (its norm weights require grad)
def norm_paths():
    """Every way SGLang calls a captured layer's input norm, on the real RMSNorm
    class: post_residual_addition (added to the residual first, out of place),
    no residual (the input is the new residual), the fused all-reduce path
    (its reduced residual_out is captured), a non-plain norm configuration
    (SGLang's own code, then a slot store), zero rows."""
    from sglang.srt.layers.layernorm import RMSNorm

    model = _build(torch.float32)
    buffer = _install(model, residual_in_slot=False)  # each call alone (path f: see below)
    layer_id = model._eagle_capture.layer_ids[0]
    slot = buffer.slot_of(layer_id)
    norm = model.model.layers[layer_id].input_layernorm
    assert isinstance(norm, RMSNorm) and type(norm) is not RMSNorm
    plain = RMSNorm(HIDDEN, eps=norm.variance_epsilon)
    plain.weight.data.copy_(norm.weight.data)
    g = torch.Generator().manual_seed(5)
    x, r, p = (torch.randn(4, HIDDEN, generator=g) for _ in range(3))
    out = {}

    # post_residual_addition: on the GPU SGLang's RMSNorm.forward_cuda adds it to
    # the residual first (a new tensor), then runs fused_add_rmsnorm: h + (r + p).
    # (forward_native, its CPU path, rounds (h + r) + p once instead; the drop-in
    # follows the GPU engine it replaces.)
    r0 = r.clone()
    x_ref, r_ref = plain.forward_native(x.clone(), r + p)
    xo, ro = norm(x.clone(), r, p)
    assert torch.equal(r, r0), "the caller's residual was modified"
    assert torch.equal(ro, r_ref) and torch.equal(xo, x_ref)
    assert torch.equal(buffer.aux[:4, slot], r_ref)
    out["post_residual_addition"] = "captured h + (r + p), as forward_cuda"

    # no residual: the input is the residual
    buffer.aux.fill_(float("nan"))
    y = norm(x.clone())
    assert torch.equal(y, plain.forward_native(x.clone()))
    assert torch.equal(buffer.aux[:4, slot], x)
    out["no_residual"] = "captured the input"

    # the fused all-reduce + add + RMSNorm path (flashinfer is GPU-only: stand in
    # for its kernel at world size 1 -- reduce = identity, fresh residual_out)
    original = RMSNorm.forward_with_allreduce_fusion

    def allreduce_standin(self, x, residual, post_residual_addition=None, **kwargs):
        return self.forward_native(x, residual, post_residual_addition)

    RMSNorm.forward_with_allreduce_fusion = allreduce_standin
    try:
        buffer.aux.fill_(float("nan"))
        before = model._eagle_capture.fallback_calls
        xo, ro = norm.forward_with_allreduce_fusion(x.clone(), r.clone())
        assert torch.equal(buffer.aux[:4, slot], ro)
        assert model._eagle_capture.fallback_calls == before + 1
    finally:
        RMSNorm.forward_with_allreduce_fusion = original
    out["allreduce_fusion"] = "captured the reduced residual_out"

    # SGLang's own forward_with_allreduce_fusion, unpatched: at world size 1 (and in
    # 0.5.23 whenever FlashInfer declines) it ends in norm_module.forward(x,
    # residual) -- our capturing forward -- on the same norm: stored once, by the
    # fused kernel, not a second time after it returns.
    buffer.aux.fill_(float("nan"))
    state = model._eagle_capture
    fused, fallback = state.fused_calls, state.fallback_calls
    x_ref, r_ref = plain.forward_native(x.clone(), r.clone())
    xo, ro = norm.forward_with_allreduce_fusion(x.clone(), r.clone())
    assert torch.equal(xo, x_ref) and torch.equal(ro, r_ref)
    assert torch.equal(buffer.aux[:4, slot], r_ref)
    assert (state.fused_calls - fused, state.fallback_calls - fallback) == (1, 0), (
        f"stores: fused {state.fused_calls - fused}, fallback {state.fallback_calls - fallback}"
    )
    out["allreduce_fusion_fallback"] = "SGLang's fallback into forward(): one store"

    # a norm configuration our kernel does not reproduce: SGLang's own code runs
    norm.cast_x_before_out_mul = True
    try:
        buffer.aux.fill_(float("nan"))
        xo, ro = norm(x.clone(), r.clone())
        plain.cast_x_before_out_mul = True
        x_ref, r_ref = plain.forward_native(x.clone(), r.clone())
        assert torch.equal(xo, x_ref) and torch.equal(buffer.aux[:4, slot], r_ref)
    finally:
        norm.cast_x_before_out_mul = False
    out["non_plain_norm"] = "SGLang's own norm, then the slot store"

    # zero rows
    xo, ro = norm(x[:0].clone(), r[:0].clone())
    assert xo.shape == (0, HIDDEN) and ro.shape == (0, HIDDEN)
    out["zero_rows"] = "ok"
    return out


@torch.no_grad()
def residual_in_slot():
    """Path f's hand-off between a captured layer's input norm and its
    post-attention norm, on SGLang's real RMSNorm classes: the post norm's other
    paths (a norm configuration our kernel does not reproduce, the fused
    all-reduce entry) keep the capture; a residual left in the slot and not
    taken is refused; forwards at or below ``residual_in_slot_above`` (SGLang's
    all-reduce fusion size at TP > 1) take path e. SGLang's own capture and
    path e are the references, bit for bit in fp32."""
    from sglang.srt.layers.layernorm import RMSNorm

    out = {}
    ref, ours = _build(torch.float32), _build(torch.float32)
    _install(ours)
    state = _state(ours)
    layer_ids = state.layer_ids
    posts = [ours.model.layers[i].post_attention_layernorm for i in layer_ids]
    assert all(isinstance(n, RMSNorm) and type(n) is not RMSNorm for n in posts)
    assert type(ours.model.layers[0].post_attention_layernorm) is RMSNorm, (
        "an uncaptured layer's post norm was swapped"
    )

    # The post norm on a configuration our kernel does not reproduce: SGLang's own
    # code runs on the spare holding a copy of the slot; the capture stays.
    for model in (ref, ours):
        for i in layer_ids:
            model.model.layers[i].post_attention_layernorm.cast_x_before_out_mul = True
    before = state.slot_residual_calls
    final_ref, aux_ref = _run(ref, 9, seed=4)
    final, aux = _run(ours, 9, seed=4)
    assert torch.equal(aux, aux_ref) and torch.equal(final, final_ref)
    assert state.slot_residual_calls - before == len(layer_ids)
    for model in (ref, ours):
        for i in layer_ids:
            model.model.layers[i].post_attention_layernorm.cast_x_before_out_mul = False
    out["post_norm_non_plain"] = "SGLang's own norm on a copy; capture and output equal"

    # The post norm's fused all-reduce entry (SGLang's own, unpatched: at world size
    # 1 it ends in the norm's forward): the strided slot is never handed to it.
    buffer = state.buffer
    layer_id = layer_ids[0]
    norm = ours.model.layers[layer_id].input_layernorm
    post = ours.model.layers[layer_id].post_attention_layernorm
    plain = RMSNorm(HIDDEN, eps=norm.variance_epsilon)
    g = torch.Generator().manual_seed(6)
    x, r, a = (torch.randn(4, HIDDEN, generator=g) for _ in range(3))
    plain.weight.data.copy_(norm.weight.data)
    x_ref, r_ref = plain.forward_native(x.clone(), r.clone())
    xo, ro = norm(x.clone(), r.clone())
    slot = buffer.slot_of(layer_id)
    assert ro.data_ptr() == buffer.aux[:4, slot].data_ptr(), "the residual is not the slot"
    assert torch.equal(ro, r_ref) and torch.equal(xo, x_ref)
    plain.weight.data.copy_(post.weight.data)
    a_ref, r2_ref = plain.forward_native(a.clone(), r_ref.clone())
    # What SGLang's fusion entry receives (FlashInfer's kernel declines a strided
    # residual, and then 0.5.13 / 0.5.20 skip the all-reduce): recorded.
    original = RMSNorm.forward_with_allreduce_fusion
    seen = []

    def recording(self, x, residual, *args, **kwargs):
        seen.append((residual.is_contiguous(), residual.data_ptr()))
        return original(self, x, residual, *args, **kwargs)

    RMSNorm.forward_with_allreduce_fusion = recording
    try:
        ao, r2 = post.forward_with_allreduce_fusion(a.clone(), ro)
    finally:
        RMSNorm.forward_with_allreduce_fusion = original
    assert seen and seen[0][0] and seen[0][1] != ro.data_ptr(), (
        f"SGLang's fusion entry got the strided slot: {seen}"
    )
    assert torch.equal(ao, a_ref) and torch.equal(r2, r2_ref)
    assert r2.data_ptr() != ro.data_ptr() and torch.equal(buffer.aux[:4, slot], r_ref), (
        "the post norm wrote into the slot"
    )
    assert state.residual_in_slot is None
    out["post_norm_allreduce_entry"] = "the spare, not the slot; capture kept"

    # The plain post norm writes the next residual into the input norm's incoming
    # residual (dead once the slot holds the new one), out of place of the slot.
    # (SGLang's CPU norm is out of place anyway; its GPU kernel, FlashInfer's
    # fused_add_rmsnorm, would overwrite the slot: tests/sglang_real/gpu_scenarios.py.)
    incoming = r.clone()
    xo, ro = norm(x.clone(), incoming)
    ao, r2 = post(a.clone(), ro)
    assert torch.equal(ao, a_ref) and torch.equal(r2, r2_ref)
    assert r2.data_ptr() == incoming.data_ptr(), "the post norm did not write into the spare"
    assert torch.equal(buffer.aux[:4, slot], r_ref) and state.residual_in_slot is None
    out["post_norm_plain"] = "next residual in the spare; capture kept"

    # A residual left in the slot that its post norm never takes: refused at the
    # next captured input norm and at the end of the forward, never served.
    norm(x.clone(), r.clone())
    _expect_raises(RuntimeError, lambda: norm(x.clone(), r.clone()), "did not take it")
    norm(x.clone(), r.clone())
    _expect_raises(RuntimeError, lambda: state.check_complete(4), "did not take it")
    state.stored_rows = {}
    out["not_taken"] = "refused"

    # At TP > 1, forwards SGLang's all-reduce fusion may take (<= its max tokens)
    # stay on path e; larger ones take path f. Both equal SGLang's own.
    state.residual_in_slot_above = 8
    for num_tokens, want in ((5, 0), (8, 0), (11, len(layer_ids))):
        before = state.slot_residual_calls
        final_ref, aux_ref = _run(ref, num_tokens, seed=num_tokens)
        final, aux = _run(ours, num_tokens, seed=num_tokens)
        assert torch.equal(aux, aux_ref) and torch.equal(final, final_ref)
        got = state.slot_residual_calls - before
        assert got == want, f"T={num_tokens}: {got} residuals in a slot, want {want}"
    out["fusion_sizes_path_e"] = "T <= 8 path e, T = 11 path f"
    return out


def names_and_weights():
    """state_dict keys, parameter names and a load_state_dict round trip are
    unchanged by the install (weight loading by name, RL weight sync)."""
    ref, ours = _build(torch.float32), _build(torch.float32)
    keys_before = list(ours.state_dict().keys())
    params_before = [n for n, _ in ours.named_parameters()]
    _install(ours)
    assert list(ours.state_dict().keys()) == keys_before
    assert [n for n, _ in ours.named_parameters()] == params_before
    # New weights loaded by name reach the fused kernel.
    sd = {k: v.clone() for k, v in ref.state_dict().items()}
    for k in sd:
        if k.endswith("input_layernorm.weight"):
            sd[k].mul_(1.5)
    ref.load_state_dict(sd, strict=True)
    ours.load_state_dict(sd, strict=True)
    final_ref, aux_ref = _run(ref, 5)
    final, aux = _run(ours, 5)
    assert torch.equal(aux, aux_ref) and torch.equal(final, final_ref)
    return {"state_dict_keys": len(keys_before)}


def torch_compiled_install_order(order: str):
    """SGLang's piecewise-CUDA-graph install (``install_torch_compiled`` sets an
    instance ``forward`` trampoline on the layer model) before or after ours;
    the eager trampoline path runs the layer loop either way."""
    from sglang.srt.compilation.compile import install_torch_compiled

    ref, ours = _build(torch.float32), _build(torch.float32)

    def piecewise(model):
        install_torch_compiled(
            model.model,
            dynamic_arg_dims={"input_ids": 0},
            backend_factory=lambda gm, example_inputs: gm,
        )
        assert "forward" in vars(model.model)  # SGLang's trampoline is in place

    if order == "before":
        _install(ours)
        piecewise(ours)
    else:
        piecewise(ours)
        _install(ours)
    final_ref, aux_ref = _run(ref, 5)
    final, aux = _run(ours, 5)
    assert torch.equal(aux, aux_ref) and torch.equal(final, final_ref)
    assert _state(ours).fused_calls == len(CAPTURE_IDS)
    return {"order": order}


def _piecewise_context():
    """SGLang's switch that makes the install_torch_compiled trampoline run the
    dynamo-compiled layer loop (name and module per line)."""
    from sglang.srt.compilation import compile as compile_module

    if hasattr(compile_module, "set_compiled"):  # 0.5.9: a context variable
        return compile_module.set_compiled(True)
    try:  # 0.5.18 and later
        from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import (
            enable_tc_piecewise_cuda_graph as enable,
        )
    except ImportError:  # 0.5.13
        from sglang.srt.compilation.piecewise_context_manager import (
            enable_piecewise_cuda_graph as enable,
        )
    return enable()


@contextlib.contextmanager
def _fused_ops_compile_mode(*models):
    """SGLang's compile pass (0.5.18+) flips every fused op into its
    compile-safe dispatch around the traced runs (``_toggle_fused_ops``: resolves
    each op's lazy forward method while still eager); earlier lines have none."""
    try:
        from sglang.srt.model_executor.runner_backend.tc_piecewise_cuda_graph_backend import (
            _toggle_fused_ops as toggle,
        )
    except ImportError:
        yield
        return
    for model in models:
        toggle(model.model, reverse=False, num_tokens=16)
    try:
        yield
    finally:
        for model in models:
            toggle(model.model, reverse=True, num_tokens=16)


def piecewise_compiled():
    """The layer loop as SGLang's piecewise CUDA graphs run it: traced by dynamo
    with ``fullgraph=True`` through SGLang's own ``install_torch_compiled``
    trampoline (backend: the traced graph run as is -- no CUDA graphs on CPU).
    Our capturing norm must trace without a graph break, and the compiled
    loop's captures must equal SGLang's own, also compiled."""
    ref, ours = _build(torch.float32), _build(torch.float32)
    _install(ours)
    return compiled_same_as_sglang(ref, ours, "layer loop")


def compiled_same_as_sglang(ref, ours, what: str) -> dict:
    """``ref`` (SGLang's own capture) and ``ours`` (installed) traced by dynamo
    through SGLang's ``install_torch_compiled`` trampoline; what the draft
    receives and the final hidden state equal at two sizes, every captured layer's
    op in each of our graphs. A skip (with the reason) where SGLang's own ``what``
    does not trace."""
    from sglang.srt.compilation.compile import install_torch_compiled

    graphs = {"ref": [], "ours": []}
    for name, model in (("ref", ref), ("ours", ours)):

        def backend(gm, example_inputs, _graphs=graphs[name]):
            _graphs.append(gm.code)
            return gm

        install_torch_compiled(
            model.model, dynamic_arg_dims={"input_ids": 0}, backend_factory=backend, fullgraph=True
        )
    # One eager forward first, as SGLang's warm-up does: it creates lazily built
    # globals (0.5.23's expert-distribution recorder) that dynamo cannot trace.
    _run(ref, 2)
    _run(ours, 2)
    torch._dynamo.reset()
    state = ours._eagle_capture
    captured = len(state.layer_ids)
    eager_captures = state.fused_calls
    out = {}
    for num_tokens in (5, 8):
        with _piecewise_context(), _fused_ops_compile_mode(ref, ours):
            try:
                final_ref, aux_ref = _run(ref, num_tokens, seed=num_tokens)
            except torch._dynamo.exc.Unsupported as e:
                # SGLang's own loop, without our install, does not trace here.
                first = str(e).splitlines()[0]
                return {
                    "skip": f"SGLang {harness.sglang_version()}'s own {what} does not "
                    f"trace under dynamo with torch {torch.__version__} (this line "
                    f"pins another torch): {first}"
                }
            final, aux = _run(ours, num_tokens, seed=num_tokens)
        assert torch.equal(aux, aux_ref), "compiled loop: aux differs from SGLang's own"
        assert torch.equal(final, final_ref), "compiled loop: final hidden differs"
        out[f"T{num_tokens}"] = "equal"
    # Proof that the compiled loop ran: as many whole-loop graphs as SGLang's own
    # (fullgraph: no break; a recompile per new size), each of ours holding our op
    # once per captured layer, and no eager (Python) capture in between.
    assert graphs["ours"] and len(graphs["ours"]) == len(graphs["ref"]), (
        f"graphs traced: ours {len(graphs['ours'])}, SGLang {len(graphs['ref'])}"
    )
    op_calls = [code.count("eagle_capture.add_rmsnorm_capture") for code in graphs["ours"]]
    assert all(n == captured for n in op_calls), f"capture ops per graph: {op_calls}"
    assert state.fused_calls == eager_captures, "the norms' Python ran: not the compiled loop"
    out["graphs"] = len(graphs["ours"])
    out["capture_ops_per_graph"] = op_calls
    return out


def layer_id_rules():
    """The doctor's per-line rules (eagle_capture.layer_ids.lines.SGLANG_LINES) against this
    wheel's own code: the layers_to_capture that set_eagle3_layers_to_capture sets
    for several draft ids, and what SGLang's own first forward then does."""
    from eagle_capture.layer_ids.lines import line_of

    line = line_of(harness.sglang_version())
    assert harness.sglang_version() in line.read_versions
    out = {}
    for ids in (
        [1, 3, 5],
        [2, 3, 5],
        [0, 3, 5],
        [-1, 3, 5],
        [-1, 2, 4],
        [1, 1, 5],
        [3, 1, 5],
        None,
    ):
        model = _build(torch.float32)
        model.set_eagle3_layers_to_capture(None if ids is None else list(ids))
        got = list(model.model.layers_to_capture)
        predicted = line.capture_layers(ids, NUM_LAYERS)
        assert got == predicted, f"ids {ids}: SGLang captures {got}, the doctor says {predicted}"
        try:
            final, aux = _run(model, 3)
            outcome = (
                "embedding"
                if 0 in got
                else "dropped"
                if aux.shape[1] < len(got) * HIDDEN
                else "captured"
            )
            if outcome == "embedding":
                with torch.no_grad():
                    emb = model.model.embed_tokens(harness.make_batch(model, 3, seed=0)[0])
                assert torch.equal(aux[:, :HIDDEN], emb), "slot 0 is not the embedding output"
        except TypeError:
            outcome = "crash"
        except (RuntimeError, AssertionError) as e:
            if "aux hidden states" not in str(e):
                raise
            outcome = "error"
        if 0 in got:
            expected = line.layer0
        elif any(layer < 0 for layer in got) or len(set(got)) < len(got):
            expected = line.missing_capture  # a layer no loop step takes (-1, a duplicate)
        else:
            expected = "captured"
        assert outcome == expected, f"ids {ids}: SGLang's forward {outcome}, doctor: {expected}"
        out[str(ids)] = f"{got}: {outcome}"
    return out


# Draft ids that tell the three id rules apart (num_layers 40): only the first
# starts at 1; the last ends at the final boundary.
_RULE_PROBES = ([1, 5, 9], [2, 5, 9], [3, 1, 9], [2, 20, 40], None)


def _call_model_rule(cls, module, ids, num_layers=40):
    """``cls``'s own ``set_eagle3_layers_to_capture`` (this wheel's code, called as
    SGLang's runner calls it) on a shell holding what the method reads; returns the
    layers it sets on its text model (or hands to the text model's own setter)."""
    import types

    class TextModel:
        layers_to_capture = None

        def set_eagle3_layers_to_capture(self, layer_ids):  # qwen3_moe, qwen2_moe, ...
            self.layers_to_capture = list(layer_ids)

    pp = types.SimpleNamespace(is_last_rank=True)
    shell = types.SimpleNamespace(
        config=types.SimpleNamespace(num_hidden_layers=num_layers),
        pp_group=pp,
        model=TextModel(),
        language_model=TextModel(),
        capture_aux_hidden_states=False,
    )
    saved = getattr(module, "get_parallel", None)  # minimax_m2 asks the parallel state
    if saved is not None:
        module.get_parallel = lambda: types.SimpleNamespace(pp_group=pp)
    try:
        cls.set_eagle3_layers_to_capture(shell, None if ids is None else list(ids))
    finally:
        if saved is not None:
            module.get_parallel = saved
    if shell.language_model.layers_to_capture is not None:
        return ("forwards", shell.language_model.layers_to_capture)
    assert shell.capture_aux_hidden_states, f"{cls.__name__} did not turn the capture on"
    return shell.model.layers_to_capture


# Packages only GPU builds have, stubbed for model_id_rules when a model file imports
# them at module level (tests/sglang_real/stubs.py: a stub raises if called).
GPU_ONLY_IMPORTS = ("tvm_ffi",)


def model_id_rules():
    """Every row of the doctor's per-model rule table
    (eagle_capture.layer_ids.rules.SGLANG_MODEL_RULES) for this wheel against the
    wheel's own model classes: each architecture a model file registers
    (EntryClass) whose class has set_eagle3_layers_to_capture, called on a shell
    with ids that tell the rules apart. On a wheel the table was read from, every
    class the shell can call must be in the table (and every row in the wheel)."""
    import importlib
    import pathlib

    from sglang.srt import models as models_pkg  # a namespace package: no __file__

    from eagle_capture.layer_ids.lines import parse_version
    from eagle_capture.layer_ids.rules import (
        SGLANG_MODEL_RULES,
        WRAPPERS,
        _read_version,
        apply_rule,
    )

    version = harness.sglang_version()
    read = _read_version(parse_version(version))
    table = SGLANG_MODEL_RULES[read]
    seen, not_imported, not_in_table, uncallable = {}, [], [], []
    for path in sorted(pathlib.Path(list(models_pkg.__path__)[0]).glob("*.py")):
        if "def set_eagle3_layers_to_capture" not in path.read_text():
            continue
        try:
            try:
                module = importlib.import_module(f"sglang.srt.models.{path.stem}")
            except ModuleNotFoundError as e:
                if e.name not in GPU_ONLY_IMPORTS:
                    raise
                # A GPU-only package imported at module level (minimax_m2 on 0.5.13 -
                # 0.5.22: tvm_ffi): stubbed (a call raises), the method needs none of it.
                stubs.install((e.name,))
                module = importlib.import_module(f"sglang.srt.models.{path.stem}")
        except Exception as e:  # noqa: BLE001 - a GPU-only import on this CPU machine
            not_imported.append(f"{path.stem}: {type(e).__name__}: {getattr(e, 'name', '')}")
            continue
        entries = getattr(module, "EntryClass", [])
        for cls in entries if isinstance(entries, (list, tuple)) else [entries]:
            if not hasattr(cls, "set_eagle3_layers_to_capture"):
                continue
            try:
                got = {str(ids): _call_model_rule(cls, module, ids) for ids in _RULE_PROBES}
            except Exception:  # noqa: BLE001 - needs more than a shell (e.g. its layers)
                uncallable.append(cls.__name__)
                continue
            arch = cls.__name__
            if arch in WRAPPERS:
                assert all(
                    v == ("forwards", list(ids) if ids else None) or ids is None
                    for ids, v in zip(_RULE_PROBES, got.values())
                ), f"{arch} does not forward the ids unchanged: {got}"
                continue
            if arch not in table:
                not_in_table.append(arch)
                continue
            rule, owner = table[arch]
            owning = next(c for c in cls.__mro__ if "set_eagle3_layers_to_capture" in c.__dict__)
            assert f"{owning.__module__.rsplit('.', 1)[-1]}.{owning.__name__}" == owner, (
                f"{arch}: the method is {owning.__module__}.{owning.__name__}'s, table: {owner}"
            )
            for ids in _RULE_PROBES:
                want = apply_rule(rule, ids, 40)
                assert got[str(ids)] == want, (
                    f"{arch} ({owner}), ids {ids}: SGLang sets {got[str(ids)]}, table: {want}"
                )
            seen[arch] = rule
    if read == version:
        assert not not_in_table, (
            f"classes of SGLang {version} missing from the table: {not_in_table}"
        )
        missing = sorted(set(table) - set(seen))
        assert not missing, f"table rows not found (or not callable) in SGLang {version}: {missing}"
    return {
        "table": read,
        "rows_checked": len(seen),
        "not_in_table": not_in_table,
        "needs_more_than_a_shell": uncallable,
        "not_importable_here": not_imported,
    }


def draft_config_reading():
    """Where the target reads the draft's ids, by running this wheel's own reader
    (0.5.17+: ``spec_aux_hidden_state._resolve_eagle_aux_hidden_state``; loading
    the draft's config from disk stood in by a ``PretrainedConfig`` of the dict) on
    nested, top-level-only and both-keys configs: what it returns must be what
    ``eagle_capture.layer_ids.lines.read_draft_ids`` says the target reads, and the
    layers SGLang then sets must be the doctor's. (Up to 0.5.16 the ids are read inline in
    ``ModelRunner.__init__``: that block of its source is executed.)"""
    import importlib
    import types

    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from transformers import PretrainedConfig

    from eagle_capture.layer_ids.lines import line_of

    try:
        spec_aux = importlib.import_module(
            "sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state"
        )
    except ImportError:
        spec_aux = None

    line = line_of(harness.sglang_version())
    cases = {
        "nested": {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 5]}},
        "top_level_only": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]},
        "both": {
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 5]},
            "eagle_aux_hidden_state_layer_ids": [1, 2, 4],
        },
        "none": {},
    }
    # The draft's path: from the runtime context's spec bag (0.5.20+) or the server
    # arguments (0.5.18).
    spec = types.SimpleNamespace(
        speculative_draft_model_path="draft", speculative_draft_model_revision=None
    )
    if spec_aux is None:
        return _draft_config_reading_in_model_runner(
            cases, spec, line, SpeculativeAlgorithm, PretrainedConfig
        )
    saved = spec_aux.ModelConfig.from_server_args, getattr(spec_aux, "get_spec", None)
    out = {}
    try:
        if saved[1] is not None:
            spec_aux.get_spec = lambda: spec
        for name, body in cases.items():
            hf = PretrainedConfig(architectures=["LlamaForCausalLMEagle3"], **body)
            draft = types.SimpleNamespace(
                hf_config=hf,
                num_nextn_predict_layers=None,
                num_hidden_layers=1,
                num_attention_layers=1,
                is_hybrid_swa=False,
                is_deepseek_v4_arch=False,
            )
            spec_aux.ModelConfig.from_server_args = staticmethod(lambda *a, **k: draft)
            resolved = spec_aux.resolve_spec_aux_hidden_state_config(
                server_args=spec,
                model_config=draft,
                spec_algorithm=SpeculativeAlgorithm.EAGLE3,
                is_draft_worker=False,
            )
            out[name] = _check_reading(name, body, resolved.eagle_aux_hidden_state_layer_ids, line)
    finally:
        spec_aux.ModelConfig.from_server_args = saved[0]
        if saved[1] is not None:
            spec_aux.get_spec = saved[1]
    return out


def _draft_config_reading_in_model_runner(cases, server_args, line, algorithm, config_class):
    """<= 0.5.16 read the ids inline in ``ModelRunner.__init__``: the statement of that
    method holding the read (0.5.9 / 0.5.13: ``if self.spec_algorithm.is_eagle3() ...``;
    0.5.14 - 0.5.16: an ``if`` on any EAGLE draft that loads the draft's config through
    ``self._build_model_config`` for KV sizing, with the EAGLE-3 read nested in it) is
    executed from the wheel's source as is, with the runner's ``self`` and the draft
    config's loading stood in (both ways of loading it answer the same stand-in)."""
    import ast
    import importlib.util
    import types

    path = importlib.util.find_spec("sglang.srt.model_executor.model_runner").origin
    text = open(path).read()
    runner_class = next(
        n for n in ast.parse(text).body if isinstance(n, ast.ClassDef) and n.name == "ModelRunner"
    )
    init = next(
        n for n in runner_class.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"
    )
    block = next(
        (
            stmt
            for stmt in init.body
            if isinstance(stmt, ast.If)
            and "self.eagle_aux_hidden_state_layer_ids =" in ast.unparse(stmt)
        ),
        None,
    )
    assert block is not None, "ModelRunner.__init__ reads no eagle_aux_hidden_state_layer_ids"
    code = compile(ast.Module(body=[block], type_ignores=[]), path, "exec")
    out = {"reader": f"ModelRunner.__init__, line {block.lineno} (executed from the source)"}
    for name, body in cases.items():
        hf = config_class(architectures=["LlamaForCausalLMEagle3"], **body)
        draft = types.SimpleNamespace(
            hf_config=hf, num_nextn_predict_layers=None, num_hidden_layers=1, num_attention_layers=1
        )
        runner = types.SimpleNamespace(
            spec_algorithm=algorithm.EAGLE3,
            is_draft_worker=False,
            _build_model_config=lambda *a, **k: draft,
        )
        model_config = types.SimpleNamespace(from_server_args=lambda *a, **k: draft)
        exec(code, {"self": runner, "server_args": server_args, "ModelConfig": model_config})
        assert hasattr(runner, "eagle_aux_hidden_state_layer_ids"), (
            f"{name}: the block at line {block.lineno} did not reach the read"
        )
        out[name] = _check_reading(name, body, runner.eagle_aux_hidden_state_layer_ids, line)
    return out


def _check_reading(name, body, got, line) -> str:
    """What the wheel's reader returned (``got``) for a draft config ``body``: what
    eagle_capture says the target reads, and the layers SGLang then sets are the
    doctor's."""
    from eagle_capture.layer_ids.lines import read_draft_ids

    want = read_draft_ids(dict(body, architectures=["LlamaForCausalLMEagle3"]))
    assert got == want.read_by_target, (
        f"{name}: SGLang's target reads {got}, eagle_capture says {want.read_by_target}"
    )
    model = _build(torch.float32)
    model.set_eagle3_layers_to_capture(None if got is None else list(got))
    layers = list(model.model.layers_to_capture)
    assert layers == line.capture_layers(want.read_by_target, NUM_LAYERS), (name, layers)
    return f"target reads {got} -> layers_to_capture {layers}"


def graph_order():
    """The doctor's CUDA-graph rule (eagle_capture.layer_ids.deployment.graphs_captured_before_ids)
    against this wheel's own call order, read from its source (graphs cannot be
    captured on CPU): <= 0.5.12 ``ModelRunner.initialize`` captures the graphs
    (``init_device_graphs``) before it sets the draft's ids, and its graph runner
    sets the defaults first; 0.5.13 sets them first (``init_aux_hidden_state_capture``);
    0.5.18+ in ``init_attention_backends`` (``configure_aux_hidden_state_capture``),
    which the scheduler runs before ``init_all_cuda_graphs``."""
    import ast
    import importlib.util

    from eagle_capture.layer_ids.deployment import graphs_captured_before_ids
    from eagle_capture.layer_ids.lines import line_of

    def functions(module: str, cls: str) -> dict:
        """{method name: [(line, name of each call in it), ...]} of a class, from
        the wheel's source (comments do not count)."""
        path = importlib.util.find_spec(module).origin
        tree = ast.parse(open(path).read())
        out = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and node.name == cls:
                for item in node.body:
                    if isinstance(item, ast.FunctionDef):
                        out[item.name] = [
                            (c.lineno, getattr(c.func, "attr", getattr(c.func, "id", "")))
                            for c in ast.walk(item)
                            if isinstance(c, ast.Call)
                        ]
        return out

    def first(calls, *names):
        lines = [n for n, name in calls if name in names]
        return min(lines) if lines else None

    runner = functions("sglang.srt.model_executor.model_runner", "ModelRunner")
    init = runner["initialize"]
    if first(init, "init_device_graphs") is not None:  # <= 0.5.17
        graphs = first(init, "init_device_graphs")
        ids = first(init, "set_eagle3_layers_to_capture", "init_aux_hidden_state_capture")
        before = graphs < ids
        graph_runner = functions("sglang.srt.model_executor.cuda_graph_runner", "CudaGraphRunner")[
            "__init__"
        ]
        defaults = first(graph_runner, "set_eagle3_layers_to_capture") is not None
        assert defaults == before, "the graph runner's default ids and the order disagree"
        how = (
            f"ModelRunner.initialize: init_device_graphs line {graphs}, the ids line {ids}; "
            f"CudaGraphRunner sets the defaults: {defaults}"
        )
    else:  # 0.5.18+: the scheduler's order
        assert first(runner["init_attention_backends"], "configure_aux_hidden_state_capture")
        sched = functions("sglang.srt.managers.scheduler", "Scheduler")
        where = [
            name
            for name, calls in sched.items()
            if first(calls, "init_all_cuda_graphs") and first(calls, "init_all_attention_backends")
        ]
        assert len(where) == 1, where
        calls = sched[where[0]]
        before = first(calls, "init_all_cuda_graphs") < first(calls, "init_all_attention_backends")
        how = (
            f"Scheduler.{where[0]}: init_all_attention_backends (the ids, via "
            f"configure_aux_hidden_state_capture) {'after' if before else 'before'} "
            f"init_all_cuda_graphs"
        )
    line = line_of(harness.sglang_version())
    assert before == graphs_captured_before_ids(line), (
        f"graphs before ids: {before} in the wheel, the doctor says {graphs_captured_before_ids(line)}"
    )
    return {"graphs_before_ids": before, "how": how}


def refusals():
    """Clear errors instead of silent wrong captures."""
    out = {}
    model = _build(torch.float32)
    out["not_enabled"] = _expect_raises(
        ValueError, lambda: _install(_build_without_capture()), "not enabled"
    )
    # A draft id of -1 (the user's embedding "fix"): each SGLang line maps it its
    # own way (<= 0.5.12: +1 -> layer 0; >= 0.5.13: kept as -1, never matched).
    emb = _build(torch.float32, capture_ids=(-1, 3))
    out["draft_ids_-1_3"] = f"layers_to_capture = {emb.model.layers_to_capture}"
    if 0 in emb.model.layers_to_capture:
        out["embedding"] = _expect_raises(ValueError, lambda: _install(emb), "embedding")
    else:
        out["negative_id"] = _expect_raises(ValueError, lambda: _install(emb), "-1")
    # Layer 0 captured on purpose (input-convention ids [0, 3]: ids[0] != 1, used raw
    # from 0.5.13): refused unless allowed; then the slot holds the embedding output.
    layer0 = _build(torch.float32, capture_ids=(0, 3))
    if 0 in layer0.model.layers_to_capture:
        out["layer_0"] = _expect_raises(ValueError, lambda: _install(layer0), "embedding")
        _install(layer0, allow_embedding=True)
        final, aux = _run(layer0, 4, seed=0)
        assert aux.shape == (4, 2 * HIDDEN)
        with torch.no_grad():
            embedding = layer0.model.embed_tokens(harness.make_batch(layer0, 4, seed=0)[0])
        assert torch.equal(aux[:, :HIDDEN], embedding), "slot 0 is not the embedding output"
    _install(model)
    out["twice"] = _expect_raises(ValueError, lambda: _install(model), "already installed")

    # SGLang's own capture re-enabled after install
    again = _build(torch.float32)
    _install(again)
    again.set_eagle3_layers_to_capture(list(CAPTURE_IDS))
    out["reenabled"] = _expect_raises(RuntimeError, lambda: _run(again, 3), "called again")

    # a captured layer whose norm is bypassed (as a fusion provider reading only
    # the weight would): the eager forward raises instead of a stale buffer
    bypass = _build(torch.float32)
    _install(bypass)
    layer_id = _state(bypass).layer_ids[1]
    norm = bypass.model.layers[layer_id].input_layernorm
    norm.__class__ = type(norm).__mro__[2]  # back to SGLang's RMSNorm
    out["bypass"] = _expect_raises(RuntimeError, lambda: _run(bypass, 3), f"[{layer_id}]")

    # two-batch overlap: the norm would see half-batches
    # Modes read from SGLang's server arguments, through the accessor this line
    # has (the install must find them: None would mean no refusal at all).
    from eagle_capture.integrations.sglang.server_modes import server_args

    args = server_args()
    assert args is not None, "eagle_capture cannot read this SGLang line's server args"
    # (DP attention and an all-to-all MoE are served where each rank's rows stay
    # whole -- an attention-TP group of one rank, as here at world 1: the TP
    # scenarios test the refusal with two, the DP scenarios the capture.)
    for field, value, match in (
        ("enable_two_batch_overlap", True, "two-batch overlap"),
        ("enable_dp_attention", True, None),
        ("moe_a2a_backend", "deepep", None),
        ("attn_cp_size", 2, "context parallelism"),
    ):
        if not hasattr(args, field):
            out[field] = "not a server argument of this line"
            continue
        model = _build(torch.float32)
        old = getattr(args, field)
        _force_setattr(args, field, value)
        try:
            if match is None:
                _install(model)
                out[field] = "installed (attention-TP group of one rank)"
            else:
                out[field] = _expect_raises(ValueError, lambda: _install(model), match)
        finally:
            _force_setattr(args, field, old)
    # more tokens than the buffer's rows (eager): a buffer for that forward alone,
    # never a failed forward mid-serving
    # (the bound at the value and one either side: MAX_TOKENS rows fit the
    # persistent buffer, one more does not)
    ref_big, too_many = _build(torch.float32), _build(torch.float32)
    _install(too_many)
    state = _state(too_many)
    for num_tokens, overflows in (
        (MAX_TOKENS - 1, 0),
        (MAX_TOKENS, 0),
        (MAX_TOKENS + 1, 1),
        (MAX_TOKENS + 5, 2),
    ):
        final_ref, aux_ref = _run(ref_big, num_tokens, seed=num_tokens)
        final, aux = _run(too_many, num_tokens, seed=num_tokens)
        assert torch.equal(aux, aux_ref) and torch.equal(final, final_ref), num_tokens
        assert state.overflow_forwards == overflows and state.overflow is None, (
            f"T={num_tokens}: {state.overflow_forwards} forwards past the buffer, want {overflows}"
        )
        if not overflows:
            assert torch.equal(state.buffer.aux[:num_tokens].flatten(1), aux_ref), (
                f"T={num_tokens}: not captured into the persistent buffer"
            )
    out["too_many_tokens"] = "served from a buffer of its own for that forward"
    return out


@torch.no_grad()
def drop_in_checks():
    """What the drop-in checks on every eager forward and where its SGLang-path
    store goes (issue 21): a captured layer's norm called again on part of the
    batch (as a half-batch scheme would) is refused at the end of the forward,
    not served; SGLang's own norm path (a configuration our kernel does not
    reproduce) at a captured layer that is not the first stores into that
    layer's slot, with SGLang's own capture as the reference."""
    out = {}
    for path in ("e", "f"):
        out[f"part_of_the_batch_path_{path}"] = _norm_called_on_part_of_the_batch(path)

    # SGLang's own norm path at the second captured layer, in both models.
    ref, ours = _build(torch.float32), _build(torch.float32)
    _install(ours)
    layer_id = _state(ours).layer_ids[1]
    for m in (ref, ours):
        m.model.layers[layer_id].input_layernorm.cast_x_before_out_mul = True
    fallback = _state(ours).fallback_calls
    final_ref, aux_ref = _run(ref, 5)
    final, aux = _run(ours, 5)
    assert _state(ours).fallback_calls == fallback + 1, "SGLang's norm path did not run"
    assert torch.equal(aux, aux_ref), "the SGLang-path store went to another slot"
    assert torch.equal(final, final_ref)
    out["sglang_norm_path_at_layer"] = (
        f"layer {layer_id}: slot {_state(ours).buffer.slot_of(layer_id)}"
    )
    return out


def _norm_called_on_part_of_the_batch(path: str) -> str:
    """A captured norm called a second time on one row of the batch: path e's
    completeness check names the rows; path f refuses the residual left behind."""
    model = _build(torch.float32)
    _install(model, residual_in_slot=path == "f")
    layer_id = _state(model).layer_ids[1]
    norm = model.model.layers[layer_id].input_layernorm
    again = [False]

    def half_batch_again(module, args, result):
        if again[0] or args[1] is None:
            return None
        again[0] = True
        try:
            module(args[0][:1].clone(), args[1][:1].clone())  # a second call on one row
        finally:
            again[0] = False
        return None

    handle = norm.register_forward_hook(half_batch_again)
    try:
        return _expect_raises(
            RuntimeError,
            lambda: _run(model, 4),
            f"layer {layer_id} stored 1 rows" if path == "e" else "did not take it",
        )
    finally:
        handle.remove()


class _CausalAttention(torch.nn.Module):
    """Stands in for RadixAttention (its kernels need a KV pool and a batch plan): causal
    attention over the one sequence, SGLang's own ``scaling``, grouped key/value heads.
    Everything around it (qkv, rope, norms, concat, fc, lm_head, d2t) is SGLang's."""

    def __init__(self, real):
        super().__init__()
        self.heads, self.kv_heads = real.tp_q_head_num, real.tp_k_head_num
        self.head_dim, self.scaling = real.head_dim, real.scaling

    def forward(self, q, k, v, forward_batch, **kwargs):
        t = q.shape[0]
        q = q.view(t, self.heads, self.head_dim).transpose(0, 1)
        k = k.view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        v = v.view(t, self.kv_heads, self.head_dim).transpose(0, 1)
        rep = self.heads // self.kv_heads
        o = torch.nn.functional.scaled_dot_product_attention(
            q,
            k.repeat_interleave(rep, 0),
            v.repeat_interleave(rep, 0),
            is_causal=True,
            scale=self.scaling,
        )
        return o.transpose(0, 1).reshape(t, -1)


def eagle3_draft_step():
    """The id probe's EAGLE-3 step (eagle_capture/probe/draft.py) against this wheel's own
    draft class, ``LlamaForCausalLMEagle3``, loading the same SpecForge checkpoint
    (tests/data/tiny_eagle3/draft_specforge) through its own ``load_weights``: same target
    states, embeddings and positions in, the same draft logits and d2t-mapped tokens out."""
    import json
    import types
    from pathlib import Path

    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    from eagle_capture.probe.draft import load_draft, read_weights

    folder = Path(__file__).resolve().parents[1] / "data" / "tiny_eagle3" / "draft_specforge"
    config = LlamaConfig(**json.loads((folder / "config.json").read_text()))
    model = LlamaForCausalLMEagle3(config).float().eval()
    model.load_weights(read_weights(folder).items())
    # <= 0.5.12: one ``midlayer``; later: ``layers`` (``midlayer.*`` weights mapped to layers.0)
    for layer in getattr(model.model, "layers", None) or [model.model.midlayer]:
        layer.self_attn.attn = _CausalAttention(layer.self_attn.attn)
    ours = load_draft(folder)
    g = torch.Generator().manual_seed(0)
    t = 11
    aux = torch.randn(t, 3 * 64, generator=g) * 3
    embeds = torch.randn(t, 64, generator=g) * 0.05
    positions = torch.arange(t)
    mode = types.SimpleNamespace(is_extend=lambda: True, is_draft_extend_v2=lambda: False)
    batch = types.SimpleNamespace(
        spec_info=types.SimpleNamespace(hidden_states=aux),
        mm_input_embeds=None,
        forward_mode=mode,
        contains_mm_inputs=lambda: False,
    )
    with torch.no_grad():
        hidden, _ = model.model(
            torch.zeros(t, dtype=torch.long), positions, batch, input_embeds=embeds
        )
        theirs = hidden @ model.lm_head.weight.T
        mine = ours(aux.unsqueeze(0), embeds.unsqueeze(0), positions.unsqueeze(0))[0]
    diff = (theirs - mine).abs().max().item()
    tokens_theirs = model.hot_token_id[theirs.argmax(-1)]
    tokens_mine = ours.to_target(mine.argmax(-1))
    assert diff <= 1e-4 * theirs.abs().max().item(), f"logits differ by {diff}"
    assert torch.equal(tokens_theirs, tokens_mine), (tokens_theirs, tokens_mine)

    # What the draft proposes when fed SGLang's own capture and the drop-in's, through
    # this class, on this wheel's DeepseekV2 loop (harness: H = 64, ids 1, 3, 5).
    def proposals(states):
        batch.spec_info.hidden_states = states
        with torch.no_grad():
            h, _ = model.model(
                torch.zeros(len(states), dtype=torch.long),
                torch.arange(len(states)),
                batch,
                input_embeds=embeds[: len(states)],
            )
        return model.hot_token_id[(h @ model.lm_head.weight.T).argmax(-1)]

    ref, fused = _build(torch.float32), _build(torch.float32)
    _install(fused)
    _, aux_ref = _run(ref, t, "extend", seed=5)
    _, aux_fused = _run(fused, t, "extend", seed=5)
    same = torch.equal(proposals(aux_ref), proposals(aux_fused))
    assert same, "the draft proposes other tokens from the drop-in's capture"
    return {
        "detail": f"{t} positions: max |logit diff| {diff:.2e} (logits up to "
        f"{theirs.abs().max().item():.2f}); tokens equal; the draft's proposals "
        f"from SGLang's capture and the drop-in's equal",
        "max_abs_diff": diff,
    }


def _force_setattr(obj, name, value) -> None:
    """From 0.5.18 resolved server args are a read-only msgspec Struct; a test
    may still flip a field."""
    try:
        setattr(obj, name, value)
    except (AttributeError, TypeError):
        import msgspec

        msgspec.structs.force_setattr(obj, name, value)


def _build_without_capture():
    model = _build(torch.float32)
    model.capture_aux_hidden_states = False
    model.model.layers_to_capture = []
    return model


SCENARIOS = {
    "same_as_sglang_fp32": lambda: same_as_sglang("float32"),
    "same_as_sglang_bf16": lambda: same_as_sglang("bfloat16"),
    "same_as_sglang_bf16_path_e": lambda: same_as_sglang("bfloat16", path="e"),
    "residual_in_slot": residual_in_slot,
    "norm_paths": norm_paths,
    "names_and_weights": names_and_weights,
    "install_before_torch_compiled": lambda: torch_compiled_install_order("before"),
    "install_after_torch_compiled": lambda: torch_compiled_install_order("after"),
    "piecewise_compiled": piecewise_compiled,
    "layer_id_rules": layer_id_rules,
    "model_id_rules": model_id_rules,
    "draft_config_reading": draft_config_reading,
    "graph_order": graph_order,
    "drop_in_checks": drop_in_checks,
    "refusals": refusals,
    "eagle3_draft_step": eagle3_draft_step,
}
SCENARIOS.update(plugin_scenarios.SCENARIOS)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", required=True)
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--skip", nargs="*", default=[])
    args = parser.parse_args()
    harness.setup()
    results = {"version": harness.sglang_version()}
    from tests.sglang_real import family_scenarios  # the other families, same process

    every = {**SCENARIOS, **{f"family_{k}": v for k, v in family_scenarios.SCENARIOS.items()}}
    for name, fn in every.items():
        if (args.only and name not in args.only) or name in args.skip:
            continue
        start = time.perf_counter()
        try:
            results[name] = {"ok": True, **(fn() or {})}
        except Exception as e:  # noqa: BLE001 - reported per scenario
            results[name] = {
                "ok": False,
                "detail": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
        results[name]["seconds"] = round(time.perf_counter() - start, 2)  # the cost, visible
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
