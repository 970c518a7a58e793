"""The capture at TENSOR PARALLEL 2 inside the REAL SGLang code: two processes on gloo.

Each TP rank is its own process (one SGLang version per process, the overlay
first on the path), as SGLang runs one scheduler process per TP rank::

    OVERLAY=$(tools/sglang_real_env.sh 0.5.23)
    PORT=29611   # any free port
    for R in 0 1; do
      PYTHONPATH=$OVERLAY:. .venv/bin/python -m tests.sglang_real.tp_scenarios \\
          --world 2 --rank $R --init-method tcp://127.0.0.1:$PORT \\
          --ref /tmp/tp1.pt --json /tmp/tp2_rank$R.json &
    done
    PYTHONPATH=$OVERLAY:. .venv/bin/python -m tests.sglang_real.tp_scenarios \\
        --world 1 --ref /tmp/tp1.pt --json /tmp/tp1.json; wait

``--world 1`` is the TP 1 run that the TP 2 ranks compare with: the same
model, stand-ins, weights and batches, SGLang's own capture, at world size 1;
it writes the captures to ``--ref`` (the ranks wait for that file in scenario
``tp2_equals_tp1``, or for ``<ref>.failed``). ``--tp1-json PATH`` on rank 0
instead forks that run from rank 0 after the imports and before any
distributed init (a process of its own, world 1, without importing SGLang a
third time): ``tests/test_sglang_real_tp.py`` runs it so, per version.

Set-up (``harness.setup(tp_size=2, rank=r, init_method=...)``): SGLang's own
distributed init at world 2 -- ServerArgs(tp_size=2) published as
run_scheduler_process does (0.5.22+: ``SpawnRanks(world_rank=spawn_world_rank(
server_args, tp_rank=r, pp_rank=0))``), ``init_distributed_environment(world_size=2,
rank=r, backend="gloo")``, ``initialize_model_parallel(tensor_model_parallel_size=2)``
(0.5.23: ``initialize_model_parallel()``, widths from the published context),
``initialize_dp_attention``, layernorm SP / ``bootstrap.init_layer_runtime``,
``initialize_moe_config``.

Real at TP 2 (SGLang's code, unmodified): all of the harness's list (model
classes, decoder layer, communicator / stage boundaries, RMSNorm, capture loop /
packer, ForwardBatch), plus the process groups themselves (GroupCoordinator on
gloo), the vocab-sharded ``VocabParallelEmbedding`` and its all-reduce, and
EVERY all-reduce of the hidden states: the stand-ins (``harness.RowParallelStandIn``)
return a row-parallel partial on each rank -- rank r contracts only its half of
the input columns, through SGLang's own ``RowParallelLinear`` loaded by SGLang's
own ``weight_loader`` -- so only the all-reduced sum is the layer's output. Who
reduces is what SGLang's real modules do, per line: attention's ``o_proj`` has
``reduce_results=False`` in every line and the communicator (<= 0.5.20) or the
stage boundary (0.5.22+) all-reduces; the dense MLP / MoE reduce themselves up
to 0.5.20 (the stand-in's ``RowParallelLinear(reduce_results=True)`` then calls
SGLang's ``tensor_model_parallel_all_reduce``), and from 0.5.22 the layer builds
them with ``reduce_results=False`` and the stage boundary sums. Scenario
``tp2_equals_tp1`` records which SGLang function ran each all-reduce.

Stood in: as the harness says (attention / MLP / MoE bodies, weights; the
LogitsProcessor is SGLang's own, its vocab-parallel lm_head and logits gather
included); in scenario ``tp2_fusion`` also the FlashInfer all-reduce + RMSNorm
fusion's GPU gate and kernel (SGLang's all-reduce + FlashInfer's math; which
layers defer and where the capture reads is SGLang's code). Not covered: DP
attention, TBO, all-to-all MoE, the aiter fusion, custom / symmetric-memory
all-reduce, NCCL, CUDA graphs.

Both ranks run the same scenarios in the same order (every forward is a
collective); a failing rank writes its JSON and exits at once, so its peer's
next collective fails instead of hanging.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import traceback

_STARTED = time.monotonic()  # before torch / sglang are imported

import torch  # noqa: E402

from tests.sglang_real import harness  # noqa: E402

NUM_LAYERS = 7
HIDDEN = 64
DRAFT_IDS = [1, 3, 5]  # SpecForge ids -> SGLang layers [2, 4, 6]
SEED = 3
# (T, mode): extend and decode batches of several sizes; the batch seed is T.
CASES = ((5, "extend"), (1, "decode"), (3, "decode"), (11, "extend"), (16, "extend"))
# The other families run at TP 2 here: one dense, one MoE (family_models.py's names).
FAMILY_ARCHS = {"LlamaForCausalLM": "llama", "Qwen3MoeForCausalLM": "qwen3_moe"}
REL_TOL = 1e-5  # TP 2 vs TP 1: fp32 rounding of the split contraction
REF_WAIT_S = 150.0

_ARGS: argparse.Namespace | None = None


def _build(arch="DeepseekV3ForCausalLM", set_capture=True):
    if arch in FAMILY_ARCHS:  # another family's own SGLang class (family_models.py)
        from tests.sglang_real import family_models

        return family_models.build(
            FAMILY_ARCHS[arch],
            dtype=torch.float32,
            capture_ids=DRAFT_IDS,
            seed=SEED,
            num_layers=NUM_LAYERS,
            hidden_size=HIDDEN,
            set_capture=set_capture,
            standin="row_parallel",
        )
    return harness.build_model(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        dtype=torch.float32,
        capture_ids=DRAFT_IDS,
        seed=SEED,
        arch=arch,
        set_capture=set_capture,
        standin="row_parallel",
    )


def _run(model, num_tokens, mode):
    call = harness.run(model, harness.make_batch(model, num_tokens, mode, seed=num_tokens))
    aux = harness.draft_input(call)  # SGLang's own LogitsProcessor output
    return call.hidden_states.clone(), None if aux is None else aux.clone()


def _group():
    """SGLang's TP group (GroupCoordinator) and its gloo cpu_group."""
    from sglang.srt.distributed import get_tp_group

    return get_tp_group()


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` of every TP rank, over SGLang's TP cpu_group (gloo)."""
    import torch.distributed as dist

    group = _group()
    out = [torch.empty_like(t) for _ in range(group.world_size)]
    dist.all_gather(out, t.contiguous(), group=group.cpu_group)
    return out


def _same_on_all_ranks(t: torch.Tensor, what: str) -> None:
    everyone = _gather(t)
    for r, other in enumerate(everyone):
        assert torch.equal(other, t), f"{what}: rank {r} differs from this rank"


def _fingerprint(t: torch.Tensor) -> str:
    import hashlib

    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


@contextlib.contextmanager
def _count_all_reduces():
    """Every torch.distributed.all_reduce in the block, keyed by the SGLang
    function that asked for it (first frame under sglang/srt outside
    sglang/srt/distributed/)."""
    import collections

    import torch.distributed as dist

    original = dist.all_reduce
    callers: collections.Counter = collections.Counter()

    def counting(*args, **kwargs):
        frame = sys._getframe(1)
        where = "?"
        while frame is not None:
            path = frame.f_code.co_filename.replace(os.sep, "/")
            if "/sglang/srt/" in path and "/sglang/srt/distributed/" not in path:
                rel = path.split("/sglang/srt/", 1)[1]
                where = f"{rel}:{frame.f_code.co_qualname}"
                break
            frame = frame.f_back
        callers[where] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        yield callers
    finally:
        dist.all_reduce = original


def _has_plugins() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang.srt.plugins") is not None


def _install_capture(model, env: dict):
    """The fused capture on ``model`` the way this SGLang line gets it: the
    plugin through the wheel's own load_plugins() and hooked configure step
    (0.5.13+), or by hand after set_eagle3_layers_to_capture (0.5.9, no plugin
    system: the README's path; the self-check set up by the plugin's own
    ``_setup_verify``). Returns (state, log records, how)."""
    from tests.sglang_real import plugin_scenarios as ps

    if _has_plugins():
        with ps.plugins_loaded(SGLANG_PLUGINS="eagle_capture", **env) as log:
            ps.configure(model, DRAFT_IDS)
        return harness.text_lm(model)._eagle_capture, log, "plugin (load_plugins + hook)"
    from eagle_capture.integrations.settings import fused_allreduce
    from eagle_capture.integrations.sglang import plugin as sglang_plugin
    from eagle_capture.integrations.sglang.dropin import install_eagle3_capture

    log = ps._Records()
    logging.getLogger("eagle_capture").addHandler(log)
    logging.getLogger("eagle_capture").setLevel(logging.DEBUG)
    model.set_eagle3_layers_to_capture(list(DRAFT_IDS))
    install_eagle3_capture(
        model,
        int(env.get("EAGLE_CAPTURE_MAX_TOKENS", 16)),
        fused_allreduce=fused_allreduce(env),
        allreduce_table=env.get("EAGLE_CAPTURE_ALLREDUCE_TABLE"),
    )
    state = harness.text_lm(model)._eagle_capture
    sglang_plugin._setup_verify(state, env)
    return state, log, "install_eagle3_capture by hand (0.5.9 has no plugin system)"


def _verifying_install(forwards: int):
    """A model with the fused capture and the live self-check of its first
    ``forwards`` eager forwards: (model, state, how it was installed)."""
    model = _build(set_capture=False)
    state, log, how = _install_capture(
        model,
        {
            "EAGLE_CAPTURE": "1",
            "EAGLE_CAPTURE_MAX_TOKENS": "16",
            "EAGLE_CAPTURE_VERIFY": str(forwards),
        },
    )
    _detach_log(log)
    return model, state, how


def _sglang_reference(arch="DeepseekV3ForCausalLM"):
    """SGLang's own capture on a model built as the plugin's is, configured by
    SGLang's own step (unhooked) or set_eagle3_layers_to_capture (0.5.9)."""
    from tests.sglang_real import plugin_scenarios as ps

    ref = _build(arch, set_capture=False)
    if _has_plugins():
        ps.configure(ref, DRAFT_IDS)
    else:
        ref.set_eagle3_layers_to_capture(list(DRAFT_IDS))
    return ref


def _detach_log(log):
    """Stop recording (a no-op for the plugin path's records, detached already)."""
    logging.getLogger("eagle_capture").removeHandler(log)


# ------------------------------------------------------------------ world 1


def reference_tp1():
    """The TP 1 run: SGLang's own capture and final hidden states for CASES,
    saved for the TP 2 ranks (same model, stand-ins, weights, batches)."""
    model = _build()
    with _count_all_reduces() as callers:
        out = {f"{t}:{mode}": _run(model, t, mode) for t, mode in CASES}
    assert not callers, f"all-reduces at world 1: {dict(callers)}"
    tmp = _ARGS.ref + f".tmp{os.getpid()}"
    torch.save(out, tmp)
    os.replace(tmp, _ARGS.ref)  # the ranks see the file complete or not at all
    return {"cases": list(out), "aux_fingerprints": {k: _fingerprint(v[1]) for k, v in out.items()}}


# ------------------------------------------------------------------ world 2


def tp2_setup():
    """SGLang's own world-2 set-up: the groups, the published ranks, the
    stand-ins' shards and who reduces (read off SGLang's real modules)."""
    import torch.distributed as dist

    rank = _ARGS.rank
    group = _group()
    assert dist.is_initialized() and dist.get_world_size() == 2 and dist.get_rank() == rank
    assert group.world_size == 2 and group.rank_in_group == rank, (
        group.world_size,
        group.rank_in_group,
    )
    from sglang.srt.distributed import parallel_state as pstate

    assert (
        pstate.get_tensor_model_parallel_world_size(),
        pstate.get_tensor_model_parallel_rank(),
    ) == (2, rank)
    out = {"init_calls": harness._STATE["init_calls"], "tp_group_ranks": list(group.ranks)}
    try:
        from sglang.srt.runtime_context import get_parallel
    except ImportError:  # <= 0.5.13: no runtime context; dp_attention's module globals
        from sglang.srt.layers import dp_attention

        attn = (dp_attention.get_attention_tp_size(), dp_attention.get_attention_tp_rank())
    else:
        parallel = get_parallel()
        assert (parallel.tp_size, parallel.tp_rank) == (2, rank), (
            parallel.tp_size,
            parallel.tp_rank,
        )
        attn = (parallel.attn_tp_size, parallel.attn_tp_rank)
        out["get_parallel"] = {"tp_size": parallel.tp_size, "tp_rank": parallel.tp_rank}
    assert attn == (2, rank), f"attention TP (size, rank) {attn}"
    out["attn_tp"] = list(attn)

    model = _build()
    lm = harness.text_lm(model)
    emb = lm.model.embed_tokens
    assert emb.weight.shape[0] == emb.num_embeddings_padded // 2, "the embedding is not sharded"
    layers = lm.model.layers
    out["reduces_itself"] = {
        "attn": [layer.self_attn.reduces for layer in layers],
        "mlp": [layer.mlp.reduces for layer in layers],
    }
    attn = layers[1].self_attn
    assert attn.cols == (32 * rank, 32 * rank + 32)
    assert attn.proj.weight.shape == (HIDDEN, HIDDEN // 2)
    # The shards differ across ranks (each rank contracts other columns).
    shards = _gather(attn.proj.weight.data)
    assert not torch.equal(shards[0], shards[1])
    assert torch.equal(torch.cat(shards, dim=1), attn.w), "shards do not make up W"
    out["standin_shard"] = (
        f"rank {rank}: input columns {attn.cols}, weight {tuple(attn.proj.weight.shape)}"
    )
    return out


def _wait_for_tp1():
    """The TP 1 run's captures (its process writes them; a failure file instead)."""
    deadline = time.monotonic() + REF_WAIT_S
    while not os.path.exists(_ARGS.ref):
        if os.path.exists(_ARGS.ref + ".failed"):
            raise RuntimeError(f"the TP 1 run failed: {open(_ARGS.ref + '.failed').read()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no TP 1 reference at {_ARGS.ref} after {REF_WAIT_S} s")
        time.sleep(0.2)
    return torch.load(_ARGS.ref)


def tp2_equals_tp1():
    """(a) SGLang's own capture (and final hidden states) at TP 2 equal the TP 1
    run within fp32 rounding, and are bit-identical on both ranks; every
    all-reduce is SGLang's. Control: each rank's partial alone is far off."""
    model = _build()
    results = {}
    with _count_all_reduces() as callers:
        for t, mode in CASES:
            results[f"{t}:{mode}"] = _run(model, t, mode)
    per_forward = sum(callers.values()) / len(CASES)

    ref = _wait_for_tp1()
    out = {
        "cases": [],
        "all_reduces_per_forward": per_forward,
        "all_reduce_callers": {k: v // len(CASES) for k, v in sorted(callers.items())},
    }
    worst = 0.0
    for key, (final, aux) in results.items():
        final_1, aux_1 = ref[key]
        assert aux is not None and aux.shape == aux_1.shape, key
        for name, got, want in (("aux", aux, aux_1), ("final", final, final_1)):
            rel = ((got - want).abs().max() / want.abs().max()).item()
            worst = max(worst, rel)
            assert rel <= REL_TOL, f"{key} {name}: TP 2 vs TP 1 relative deviation {rel:.3g}"
            assert torch.allclose(got, want, rtol=REL_TOL, atol=REL_TOL * want.abs().max().item())
        _same_on_all_ranks(aux, f"{key} SGLang's own aux")
        _same_on_all_ranks(final, f"{key} final hidden")
        out["cases"].append(
            {
                "case": key,
                "aux_fingerprint": _fingerprint(aux),
                "bit_equal_to_tp1": bool(torch.equal(aux, aux_1)),
            }
        )
    out["max_rel_dev_vs_tp1"] = worst
    # No layer asked its MLP / MoE to leave the reduce to a fused next-layer norm
    # or a reduce-scatter (both need GPU kernels / DP attention): the plain path.
    layers = harness.text_lm(model).model.layers
    out["skip_all_reduce_requests"] = sum(layer.mlp.skips for layer in layers)
    # 1 (embedding) + 2 per layer (after attention, after the MLP / MoE)
    assert per_forward == 1 + 2 * NUM_LAYERS, f"{per_forward} all-reduces per forward: {callers}"

    # Control: the stand-in's per-rank partial is not the layer output (a
    # missing all-reduce cannot hide): partials differ across ranks and only
    # their sum is the full contraction.
    attn = harness.text_lm(model).model.layers[1].self_attn
    h = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(9))
    act = 0.5 * torch.tanh(h)
    partial = act[:, attn.cols[0] : attn.cols[1]] @ attn.proj.weight.t()
    parts = _gather(partial)
    full = act @ attn.w.t()
    assert torch.allclose(parts[0] + parts[1], full, rtol=1e-5, atol=1e-6)
    off = ((partial - full).abs().max() / full.abs().max()).item()
    assert off > 0.1, f"a rank's partial is only {off:.3g} off the full output"
    out["one_rank_partial_rel_off"] = off
    return out


@contextlib.contextmanager
def _allreduce_fusion_stood_in(declines: bool = False):
    """SGLang's FlashInfer all-reduce + residual + RMSNorm fusion turned on, with
    only the two GPU-bound pieces stood in: the hardware gate (sm90 / FlashInfer
    / the backend flag: here just SGLang's token bound, 0 < T <= 2048) in every
    module that holds it, and FlashInfer's kernel
    (``flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm``) by SGLang's
    own ``tensor_model_parallel_all_reduce`` followed by FlashInfer's math (fp32
    sum, residual_out rounded once, the norm of the fp32 sum). Which layers defer
    their all-reduce, which norm takes the fused path and what the capture reads
    is SGLang's code. Yields the number of fused calls. ``declines``: the kernel
    declines every call (returns (None, None), as FlashInfer does when its
    workspace cannot be set up): SGLang's fallback runs."""
    import importlib

    from sglang.srt.distributed import tensor_model_parallel_all_reduce

    calls = [0]

    def gate(batch_size, *args, **kwargs):
        return 0 < batch_size <= 2048

    def kernel(input_tensor, residual, weight, eps=1e-6, *args, **kwargs):
        calls[0] += 1
        if declines:
            return None, None
        reduced = tensor_model_parallel_all_reduce(input_tensor.clone())
        s = reduced.float() + residual.float()
        norm = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        return norm.to(input_tensor.dtype), s.to(residual.dtype)

    saved = []
    for name, attr, value in (
        ("sglang.srt.layers.communicator", "apply_flashinfer_allreduce_fusion", gate),
        (
            "sglang.srt.layers.layer_boundary.residual.add_norm",
            "flashinfer_ar_fusion_applies",
            gate,
        ),
        ("sglang.srt.layers.layer_boundary.exit", "flashinfer_ar_fusion_applies", gate),
        (
            "sglang.srt.layers.layer_boundary.fusions.allreduce",
            "flashinfer_ar_fusion_applies",
            gate,
        ),
        (
            "sglang.srt.layers.flashinfer_comm_fusion",
            "flashinfer_allreduce_residual_rmsnorm",
            kernel,
        ),
    ):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, attr):
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, value)
    try:
        yield calls
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def tp2_fusion():
    """(f) TP 2 with SGLang's all-reduce fusion on (gate and kernel stood in, see
    _allreduce_fusion_stood_in): SGLang's own capture vs the TP 1 run, per line,
    and the drop-in's. The doctor's verdicts (eagle_capture/layer_ids/deployment.py) say:
    0.5.9 - 0.5.13 capture hidden_states + residual in the loop BEFORE the layer
    whose fused input norm completes the previous layer's deferred all-reduce,
    so a captured layer after a deferring one holds per-rank partial sums; from
    0.5.14 the layer captures the reduced residual after its input norm. The drop-in captures the
    fused norm's reduced residual_out on every line. Both must hold here."""
    from eagle_capture.layer_ids.lines import line_of

    ref_tp1 = _wait_for_tp1()
    line = line_of(harness.sglang_version())
    loop_capture = line.first < (0, 5, 14)  # (deployment.py's rows say the same)
    sglang = _sglang_reference()
    ours = _build(set_capture=False)
    state, log, how = _install_capture(
        ours, {"EAGLE_CAPTURE": "1", "EAGLE_CAPTURE_MAX_TOKENS": "16"}
    )
    _detach_log(log)
    out = {"how": how, "sglang_vs_tp1": {}, "dropin_vs_tp1": {}}
    with _allreduce_fusion_stood_in() as calls:
        for t, mode in CASES:
            key = f"{t}:{mode}"
            final_1, aux_1 = ref_tp1[key]
            final_s, aux_s = _run(sglang, t, mode)
            final_d, aux_d = _run(ours, t, mode)
            # The model's own output is right with the fusion (SGLang's code is
            # not broken there): a check on the stand-in.
            for name, got in (("SGLang's final", final_s), ("drop-in's final", final_d)):
                rel = ((got - final_1).abs().max() / final_1.abs().max()).item()
                assert rel <= REL_TOL, f"{key} {name} vs TP 1: {rel:.3g}"
            rel_s = ((aux_s - aux_1).abs().max() / aux_1.abs().max()).item()
            rel_d = ((aux_d - aux_1).abs().max() / aux_1.abs().max()).item()
            out["sglang_vs_tp1"][key] = rel_s
            out["dropin_vs_tp1"][key] = rel_d
            assert rel_d <= REL_TOL, f"{key}: the drop-in's capture is {rel_d:.3g} off TP 1"
            _same_on_all_ranks(aux_d, f"{key} drop-in capture")
            if loop_capture:
                assert rel_s > 0.05, (
                    f"{key}: SGLang {harness.sglang_version()}'s own capture "
                    f"is reduced ({rel_s:.3g} off TP 1), the doctor says "
                    f"per-rank partial sums"
                )
            else:
                assert rel_s <= REL_TOL, f"{key}: SGLang's own capture is {rel_s:.3g} off TP 1"
                _same_on_all_ranks(aux_s, f"{key} SGLang's own capture")
    assert calls[0] > 0, "the fused path never ran"
    out["fused_kernel_calls"] = calls[0]
    out["sglang_capture"] = (
        "per-rank partial sums (the doctor's PROBLEM)" if loop_capture else "reduced"
    )
    return out


@contextlib.contextmanager
def _captured_fusion_inputs(model):
    """What each captured layer's ``forward_with_allreduce_fusion`` receives:
    yields a list of (layer id, partial, residual) copies, in call order."""
    lm = harness.text_lm(model)
    state = lm._eagle_capture
    cls = type(lm.model.layers[state.layer_ids[0]].input_layernorm)
    original = cls.forward_with_allreduce_fusion
    seen = []

    def recording(self, x, residual=None, *args, **kwargs):
        seen.append(
            (self._eagle_layer_id, x.clone(), None if residual is None else residual.clone())
        )
        return original(self, x, residual, *args, **kwargs)

    cls.forward_with_allreduce_fusion = recording
    try:
        yield seen
    finally:
        cls.forward_with_allreduce_fusion = original


def _check_reduced_captures(state, seen, num_tokens) -> int:
    """Each captured layer's capture is all_reduce(partial) + residual of what
    its fused norm received (fp32, one add: bit-exact), reduced here by SGLang's
    own TP all-reduce. Returns the number of layers checked."""
    from sglang.srt.distributed import tensor_model_parallel_all_reduce

    for layer, partial, residual in seen:
        want = tensor_model_parallel_all_reduce(partial.clone()) + residual
        got = state.buffer.aux[:num_tokens, state.buffer.slot_of(layer)]
        assert torch.equal(got, want), (
            f"layer {layer}: the capture is not all_reduce(partial) + residual (max deviation "
            f"{(got - want).abs().max().item():.3g}; from the partial alone "
            f"{(got - partial - residual).abs().max().item():.3g})"
        )
    return len(seen)


def tp2_fused_allreduce():
    """(g) EAGLE_CAPTURE_FUSED_ALLREDUCE=1 at TP 2 (SGLang's fusion gate and
    kernel stood in as in tp2_fusion): the captured layers' deferred all-reduce
    run by the drop-in per its path table -- on CPU no one-shot kernel exists,
    so one_shot rows take SGLang's all-reduce (gloo) + the fused op (nccl), and
    engine_fusion rows SGLang's fusion + the copy. Captures and outputs equal
    the TP 1 run and are identical on both ranks; each captured layer's capture
    is the all-reduced partial + residual it received; SGLang's fusion kernel
    runs only at the layers and sizes the table leaves to it."""
    import json as json_module
    import tempfile

    ref_tp1 = _wait_for_tp1()
    sglang = _sglang_reference()
    table = {
        "format": "eagle_capture.parallel.paths/1",
        "hidden_size": HIDDEN,
        "paths": {"2": [[3, "one_shot"], [5, "nccl"], [16, "engine_fusion"]]},
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json_module.dump(table, f)
    try:
        ours = _build(set_capture=False)
        state, log, how = _install_capture(
            ours,
            {
                "EAGLE_CAPTURE": "1",
                "EAGLE_CAPTURE_MAX_TOKENS": "16",
                "EAGLE_CAPTURE_FUSED_ALLREDUCE": "1",
                "EAGLE_CAPTURE_ALLREDUCE_TABLE": f.name,
            },
        )
    finally:
        os.unlink(f.name)
    _detach_log(log)
    reducer = state.allreduce
    assert reducer is not None, f"the fused all-reduce did not install: {log.text()}"
    assert reducer.one_shot is None  # CPU: no symmetric memory
    paths = {t: reducer.path_for(t) for t, _ in CASES}
    assert paths == {5: "nccl", 1: "nccl", 3: "nccl", 11: "engine_fusion", 16: "engine_fusion"}, (
        paths
    )
    out = {
        "how": how,
        "paths": paths,
        "dropin_vs_tp1": {},
        "sglang_kernel_calls": {},
        "layers_checked": 0,
    }
    with _allreduce_fusion_stood_in() as calls:
        for t, mode in CASES:
            key = f"{t}:{mode}"
            final_1, aux_1 = ref_tp1[key]
            before = calls[0]
            _run(sglang, t, mode)
            sglang_calls, before = calls[0] - before, calls[0]
            reducer.calls.clear()
            with _captured_fusion_inputs(ours) as seen:
                final_d, aux_d = _run(ours, t, mode)
            ours_calls = calls[0] - before
            out["layers_checked"] += _check_reduced_captures(state, seen, t)
            for name, got, want in (("final", final_d, final_1), ("capture", aux_d, aux_1)):
                rel = ((got - want).abs().max() / want.abs().max()).item()
                assert rel <= REL_TOL, f"{key}: the drop-in's {name} is {rel:.3g} off TP 1"
            out["dropin_vs_tp1"][key] = ((aux_d - aux_1).abs().max() / aux_1.abs().max()).item()
            _same_on_all_ranks(aux_d, f"{key} drop-in capture")
            _same_on_all_ranks(final_d, f"{key} drop-in final")
            fused_here = len(seen)
            assert fused_here > 0, f"{key}: no captured layer took SGLang's fused entry"
            if paths[t] == "nccl":
                assert reducer.calls == {"nccl": fused_here}, (key, reducer.calls)
                # SGLang's kernel ran at the other deferring layers only.
                assert ours_calls == sglang_calls - fused_here, (key, ours_calls, sglang_calls)
            else:
                assert reducer.calls == {"engine_fusion": fused_here}, (key, reducer.calls)
                assert ours_calls == sglang_calls, (key, ours_calls, sglang_calls)
            out["sglang_kernel_calls"][key] = {
                "sglang_own": sglang_calls,
                "dropin": ours_calls,
                "captured_layers_fused": fused_here,
            }
    return out


def tp2_fusion_declines():
    """(h) SGLang's fused kernel declines every call (FlashInfer without a
    workspace): SGLang <= 0.5.20 then runs its norm on the per-rank partial
    (SGLang's own outputs are off the TP 1 run: the control), 0.5.22+ reduces
    first. The drop-in's captured layers reduce first on every line, exactly
    once (their captures are all_reduce(partial) + residual), with the switch
    off (SGLang's fallback, then the captured norm) and on (the drop-in's own
    path: SGLang's kernel never called at captured layers)."""
    ref_tp1 = _wait_for_tp1()
    sglang = _sglang_reference()
    off = _build(set_capture=False)
    state_off, log, _ = _install_capture(
        off, {"EAGLE_CAPTURE": "1", "EAGLE_CAPTURE_MAX_TOKENS": "16"}
    )
    _detach_log(log)
    on = _build(set_capture=False)
    state_on, log, how = _install_capture(
        on,
        {
            "EAGLE_CAPTURE": "1",
            "EAGLE_CAPTURE_MAX_TOKENS": "16",
            "EAGLE_CAPTURE_FUSED_ALLREDUCE": "1",
        },
    )
    _detach_log(log)
    reduces_itself = state_off.fallback_reduces
    out = {
        "how": how,
        "sglang_fallback_reduces": reduces_itself,
        "sglang_vs_tp1": {},
        "layers_checked": 0,
    }
    with _allreduce_fusion_stood_in(declines=True) as calls:
        for t, mode in CASES:
            key = f"{t}:{mode}"
            final_1, _ = ref_tp1[key]
            final_s, _ = _run(sglang, t, mode)
            rel = ((final_s - final_1).abs().max() / final_1.abs().max()).item()
            out["sglang_vs_tp1"][key] = rel
            if reduces_itself:
                assert rel <= REL_TOL, f"{key}: SGLang's own fallback is {rel:.3g} off TP 1"
            else:
                assert rel > 0.05, f"{key}: SGLang's fallback is reduced ({rel:.3g} off TP 1)"
            before = state_off.reduced_on_decline
            with _captured_fusion_inputs(off) as seen:
                _run(off, t, mode)
            out["layers_checked"] += _check_reduced_captures(state_off, seen, t)
            assert seen, f"{key}: no captured layer took SGLang's fused entry"
            reduced = state_off.reduced_on_decline - before
            assert reduced == (0 if reduces_itself else len(seen)), (key, reduced, len(seen))
            before = calls[0]
            with _captured_fusion_inputs(on) as seen_on:
                _run(on, t, mode)
            out["layers_checked"] += _check_reduced_captures(state_on, seen_on, t)
            assert state_on.allreduce.calls["nccl"] >= len(seen_on) > 0
    # SGLang's kernel was asked only by layers that are not captured.
    out["kernel_calls"] = calls[0]
    return out


def verify_fused_allreduce_tp2():
    """(i) The live self-check with EAGLE_CAPTURE_FUSED_ALLREDUCE=1: SGLang's
    all-reduce and norm on copies at each captured layer the drop-in reduces
    itself (the nccl path: captures bit-exact), three forwards, every rank the
    same verdict, the capture left on."""
    from tests.sglang_real import plugin_scenarios as ps

    model = _build(set_capture=False)
    records = ps._Records()
    logging.getLogger("eagle_capture").addHandler(records)
    try:
        state, log, how = _install_capture(
            model,
            {
                "EAGLE_CAPTURE": "1",
                "EAGLE_CAPTURE_MAX_TOKENS": "16",
                "EAGLE_CAPTURE_FUSED_ALLREDUCE": "1",
                "EAGLE_CAPTURE_VERIFY": "3",
            },
        )
        _detach_log(log)
        with _allreduce_fusion_stood_in():
            for t, mode in ((5, "extend"), (1, "decode"), (3, "decode")):
                _run(model, t, mode)
    finally:
        _detach_log(records)
    assert state.allreduce.calls["nccl"] > 0, state.allreduce.calls
    info = records.text(logging.INFO)
    assert not state.disabled and state.verified_forwards == 3, records.text()
    assert info.count("captures bit-identical to SGLang's own") == 3, info
    assert "MISMATCH" not in records.text(), records.text()
    return {"how": how, "paths": dict(state.allreduce.calls)}


def _plugin_equals_sglang(arch: str):

    if arch == "KimiK25ForConditionalGeneration":
        import importlib.util

        if importlib.util.find_spec("sglang.srt.models.kimi_k25") is None:
            return {"skip": f"SGLang {harness.sglang_version()} has no kimi_k25.py"}
        from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration

        if not hasattr(KimiK25ForConditionalGeneration, "set_eagle3_layers_to_capture"):
            return {
                "skip": f"SGLang {harness.sglang_version()}'s KimiK25ForConditionalGeneration "
                f"has no set_eagle3_layers_to_capture (no EAGLE-3 capture of its own "
                f"to replace) and this line has no plugin system"
            }
    ref = _sglang_reference(arch)
    ours = _build(arch, set_capture=False)
    state, log, how = _install_capture(
        ours, {"EAGLE_CAPTURE": "1", "EAGLE_CAPTURE_MAX_TOKENS": "16"}
    )
    try:
        lm = harness.text_lm(ours)
        assert lm.model.layers_to_capture == [] and not lm.capture_aux_hidden_states
        assert state.layer_ids == [2, 4, 6] and state.buffer.max_tokens == 16
        cases = ((5, "extend"), (1, "decode"), (3, "decode"), (11, "extend"))
        prints = []
        for t, mode in cases:
            final_ref, aux_ref = _run(ref, t, mode)
            final, aux = _run(ours, t, mode)
            assert aux is not None and aux.shape == aux_ref.shape, (t, mode)
            assert torch.equal(aux, aux_ref), f"T={t} {mode}: aux differs from SGLang's own TP 2"
            assert torch.equal(final, final_ref), f"T={t} {mode}: final hidden differs"
            _same_on_all_ranks(aux, f"T={t} {mode} fused capture")
            prints.append(_fingerprint(aux))
        assert state.fused_calls == len(cases) * 3 and state.fallback_calls == 0, (
            state.fused_calls,
            state.fallback_calls,
        )
        text = log.text(logging.INFO)
        if _has_plugins():
            assert "fused EAGLE-3 capture ON" in text and "[16, 3, 64]" in text, text
            assert f"TP rank {_ARGS.rank}" in text, text
    finally:
        _detach_log(log)
    return {
        "how": how,
        "aux_fingerprints": prints,
        "log": [m for _, m in log.lines if "capture ON" in m],
    }


def plugin_tp2():
    """(b) The plugin installs at TP 2 on both ranks (EAGLE_CAPTURE=1,
    EAGLE_CAPTURE_MAX_TOKENS=16) and its captures equal SGLang's own TP 2
    captures bit for bit on each rank, over extend / decode batches."""
    return _plugin_equals_sglang("DeepseekV3ForCausalLM")


def plugin_kimi_k25_tp2():
    """(e) The same on SGLang's own KimiK25ForConditionalGeneration at TP 2."""
    return _plugin_equals_sglang("KimiK25ForConditionalGeneration")


def plugin_llama_tp2():
    """(f) The plugin on SGLang's own LlamaForCausalLM at TP 2 (row-parallel stand-ins
    reduced by SGLang's own code): captures equal SGLang's own TP 2 captures."""
    return _plugin_equals_sglang("LlamaForCausalLM")


def plugin_qwen3_moe_tp2():
    """(g) The same on SGLang's own Qwen3MoeForCausalLM (its per-layer capture marks)."""
    return _plugin_equals_sglang("Qwen3MoeForCausalLM")


def verify_tp2():
    """(c) EAGLE_CAPTURE_VERIFY=2 at TP 2: the self-check's group is SGLang's
    TP group (gloo cpu_group, 2 ranks) and each verified forward logs that the
    captures are identical on all 2 TP ranks; then the self-check is off."""
    import torch.distributed as dist

    from tests.sglang_real import plugin_scenarios as ps

    ref = _sglang_reference()
    ours, state, how = _verifying_install(2)
    group = state.verify_group
    assert group is not None, "verify_group is None at TP 2: the cross-rank check is off"
    assert group is _group().cpu_group, "verify_group is not SGLang's TP cpu_group"
    assert dist.get_world_size(group) == 2
    records = ps._Records()
    logging.getLogger("eagle_capture").addHandler(records)
    try:
        for t, mode in ((5, "extend"), (3, "decode"), (4, "extend")):
            final_ref, aux_ref = _run(ref, t, mode)
            final, aux = _run(ours, t, mode)
            assert torch.equal(aux, aux_ref) and torch.equal(final, final_ref), (t, mode)
    finally:
        _detach_log(records)
    lines = [m for _, m in records.lines if m.startswith("eagle_capture verify")]
    assert len(lines) == 3, lines
    for line in lines[:2]:
        assert "bit-identical" in line and "identical on all 2 TP ranks" in line, line
    assert "1/2" in lines[0] and "2/2" in lines[1] and "self-check off" in lines[2], lines
    assert not records.text(logging.ERROR), records.text(logging.ERROR)
    assert not state.disabled
    return {"how": how, "lines": lines[:2]}


def planted_divergence_tp2():
    """(d) A capture that diverges on rank 1 only, planted AFTER the per-layer
    comparison with SGLang's own (that rank's self-check passed): the
    cross-rank check names the layer and slot, on both ranks. Then the same
    with check_capture_consistency called directly on the installed buffer."""
    from eagle_capture.parallel.tp import CaptureConsistencyError, check_capture_consistency
    from tests.sglang_real import plugin_scenarios as ps

    rank = _ARGS.rank
    model = _build(set_capture=False)
    state, log, how = _install_capture(
        model, {"EAGLE_CAPTURE": "1", "EAGLE_CAPTURE_MAX_TOKENS": "16", "EAGLE_CAPTURE_VERIFY": "2"}
    )
    _detach_log(log)
    slot = state.buffer.slot_of(4)
    assert slot == 1
    finish = state.finish_verified_forward

    def plant(buffer, num_tokens):
        if rank == 1:  # after every layer's comparison with SGLang's own passed
            buffer.aux[2, slot, 7] += 1.0
        return finish(buffer, num_tokens)

    state.finish_verified_forward = plant
    records = ps._Records()
    logging.getLogger("eagle_capture").addHandler(records)
    try:
        _run(model, 5, "extend")
    finally:
        _detach_log(records)
        del state.finish_verified_forward
    errors = records.text(logging.ERROR)
    assert "NOT identical" in errors or "not consistent" in errors, records.text()
    assert "layer 4 (slot 1)" in errors, errors
    assert "ranks [0, 1] differ" in errors, errors
    assert not any(f"layer {i} (slot" in errors for i in (2, 6)), errors
    info = [m for _, m in records.lines if m.startswith("eagle_capture verify")]
    assert any("NOT identical across the 2 TP ranks" in m for m in info), info
    out = {
        "how": how,
        "self_check_error": errors.splitlines()[0][:300],
        "self_check_detail": [line.strip() for line in errors.splitlines()[1:3]],
    }

    # Direct: the installed buffer after a correct forward is consistent; rank 1's
    # slot of layer 6 corrupted in one element is named.
    _run(model, 6, "extend")  # self-check 2/2 (consistent again)
    buffer = state.buffer
    check_capture_consistency(buffer, 6, HIDDEN, state.verify_group)
    if rank == 1:
        buffer.aux[5, buffer.slot_of(6), 63] += 1.0
    try:
        check_capture_consistency(buffer, 6, HIDDEN, state.verify_group)
    except CaptureConsistencyError as e:
        message = str(e)
    else:
        raise AssertionError("a rank-1-only divergence of layer 6 was not reported")
    assert "layer 6 (slot 2)" in message and "ranks [0, 1] differ" in message, message
    assert "layer 2 (slot 0)" not in message and "layer 4 (slot 1)" not in message, message
    out["direct"] = message.splitlines()[0][:200] + " | " + message.splitlines()[1].strip()
    return out


def verify_switch_back_tp2():
    """A self-check MISMATCH on rank 1 only (a wrong capture planted in its fused
    kernel's output for layer 4): that rank serves SGLang's values and switches
    back to SGLang's own capture. The switch must be taken by BOTH ranks: a rank
    that keeps verifying enters the cross-rank all_gather (a collective on the
    TP group) on its next forward alone, and the TP group hangs (gloo here; with
    NCCL it is paired with the other rank's next all-reduce on the same
    communicator). Checked without that next forward: after the planted one,
    the ranks' (disabled, verify_left) are gathered and compared, then the
    next forwards run (they would hang if one rank still verified)."""
    from tests.sglang_real import plugin_scenarios as ps

    rank = _ARGS.rank
    ref = _sglang_reference()
    model, state, how = _verifying_install(3)
    records = ps._Records()
    logging.getLogger("eagle_capture").addHandler(records)
    try:
        final_ref, aux_ref = _run(ref, 5, "extend")
        with (
            ps.planted_capture_fault(state.buffer.slot_of(4))
            if rank == 1
            else contextlib.nullcontext()
        ):
            final, aux = _run(model, 5, "extend")
    finally:
        _detach_log(records)
    # That forward: each rank hands the draft SGLang's values (rank 1 corrected it).
    assert torch.equal(aux, aux_ref) and torch.equal(final, final_ref)
    errors = records.text(logging.ERROR)
    if rank == 1:
        assert "MISMATCH" in errors and "layer 4 (slot 1)" in errors, errors
        assert state.disabled
    mine = torch.tensor([int(state.disabled), state.verify_left], dtype=torch.int64)
    everyone = [tuple(t.tolist()) for t in _gather(mine)]
    out = {"how": how, "disabled_verify_left_per_rank": everyone}
    assert len(set(everyone)) == 1 and everyone[0][0] == 1, (
        f"the switch back after a self-check mismatch is rank-local: {everyone}"
    )
    if rank == 0:
        assert "another TP rank" in errors, errors
    # Both ranks switched together: the next forwards are collective-safe.
    for t, mode in ((4, "extend"), (2, "decode")):
        final_ref, aux_ref = _run(ref, t, mode)
        final, aux = _run(model, t, mode)
        assert torch.equal(aux, aux_ref) and torch.equal(final, final_ref), (t, mode)
    return out


WORLD2 = {
    "tp2_setup": tp2_setup,
    "plugin_tp2": plugin_tp2,
    "verify_tp2": verify_tp2,
    "planted_divergence_tp2": planted_divergence_tp2,
    "verify_switch_back_tp2": verify_switch_back_tp2,
    "plugin_kimi_k25_tp2": plugin_kimi_k25_tp2,
    "plugin_llama_tp2": plugin_llama_tp2,
    "plugin_qwen3_moe_tp2": plugin_qwen3_moe_tp2,
    "tp2_equals_tp1": tp2_equals_tp1,  # late: the TP 1 process has had time to write
    "tp2_fusion": tp2_fusion,
    "tp2_fused_allreduce": tp2_fused_allreduce,
    "tp2_fusion_declines": tp2_fusion_declines,
    "verify_fused_allreduce_tp2": verify_fused_allreduce_tp2,
}
WORLD1 = {"reference_tp1": reference_tp1}


def _preimport() -> None:
    """Import what set-up, model build and forward import -- and nothing else
    (no distributed init, no torch op): what a forked TP 1 run shares with its
    parent. The GPU-only stubs go first, as harness.setup() installs them."""
    import importlib

    harness._ensure_stubs()
    for name in (
        "sglang.srt.server_args",
        "sglang.srt.runtime_context",
        "sglang.srt.distributed.parallel_state",
        "sglang.srt.layers.dp_attention",
        "sglang.srt.distributed.bootstrap",
        "sglang.srt.layers.layernorm_sp",
        "sglang.srt.layers.moe.utils",
        "sglang.srt.model_loader.utils",
        "sglang.srt.models.deepseek_v2",
        "sglang.srt.layers.linear",
        "sglang.srt.model_executor.forward_batch_info",
    ):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # not in this line


def _run_world(args, results: dict, write) -> int:
    """Set up this process's world, run its scenarios; the exit status. The TP 1
    run leaves ``<ref>.failed`` when it fails, so that the ranks stop waiting."""
    status = _run_scenarios(args, results, write)
    if status and args.world == 1:
        with open(args.ref + ".failed", "w") as f:
            f.write(
                next(
                    (
                        f"{k}: {v['detail']}"
                        for k, v in results.items()
                        if isinstance(v, dict) and not v.get("ok")
                    ),
                    "?",
                )
            )
    return status


def _run_scenarios(args, results: dict, write) -> int:
    try:
        if args.world == 1:
            harness.setup()
        else:
            harness.setup(
                tp_size=2,
                rank=args.rank,
                init_method=args.init_method,
                dist_timeout=args.dist_timeout,
            )
        results["version"] = harness.sglang_version()
        results["setup_seconds"] = round(time.monotonic() - _STARTED, 2)
    except Exception as e:  # noqa: BLE001
        results["setup"] = {
            "ok": False,
            "detail": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc(),
        }
        write()
        return 1
    return run_each(WORLD1 if args.world == 1 else WORLD2, args.only, results, write, args.world)


def run_each(scenarios: dict, only, results: dict, write, world: int) -> int:
    """Run ``scenarios`` in order (those in ``only``, if given), each result
    written as it comes; the exit status. Every forward is a collective: a
    failing scenario ends the process at once."""
    for name, fn in scenarios.items():
        if only and name not in only:
            continue
        started = time.monotonic()
        try:
            results[name] = {"ok": True, **(fn() or {})}
        except Exception as e:  # noqa: BLE001 - reported per scenario
            results[name] = {
                "ok": False,
                "detail": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
            write()
            # The peer is inside (or about to enter) a collective this rank will
            # not join: leave now, so that it fails on the closed connection.
            return 1
        results[name]["seconds"] = round(time.monotonic() - started, 2)
        write()
    if world > 1:
        import torch.distributed as dist

        dist.barrier(group=_group().cpu_group)  # neither rank leaves mid-collective
    results["process_seconds"] = round(time.monotonic() - _STARTED, 2)
    write()
    return 0


def _writer(path: str, results: dict):
    def write():
        with open(path + ".tmp", "w") as f:
            json.dump(results, f, indent=1, default=str)
        os.replace(path + ".tmp", path)

    return write


def _exit(status: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # no interpreter teardown of gloo groups (or of a fork's parent state)


def main(argv=None) -> None:
    global _ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, choices=(1, 2), required=True)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--init-method", default=None, help="tcp://127.0.0.1:PORT (world 2)")
    parser.add_argument("--ref", required=True, help="the TP 1 captures (.pt)")
    parser.add_argument("--json", required=True)
    parser.add_argument(
        "--tp1-json",
        default=None,
        help="world 2, rank 0: also run the TP 1 reference, in a process "
        "forked after the imports (before any distributed init), "
        "writing its results here",
    )
    parser.add_argument("--only", nargs="*")
    parser.add_argument("--dist-timeout", type=int, default=120)
    _ARGS = args = parser.parse_args(argv)
    child = None
    if args.tp1_json and args.world == 2 and args.rank == 0:
        _preimport()
        child = os.fork()
        if child == 0:  # the TP 1 run: a process of its own, world 1
            args.world, args.rank, args.json, args.only = 1, 0, args.tp1_json, None
            results = {"world": 1, "rank": 0, "forked_from_rank0": True}
            status = _run_world(args, results, _writer(args.json, results))
            _exit(status)
    results = {"world": args.world, "rank": args.rank}
    status = _run_world(args, results, _writer(args.json, results))
    if child is not None and status == 0:
        _, child_status = os.waitpid(child, 0)
        status = 0 if os.waitstatus_to_exitcode(child_status) == 0 else 1
    _exit(status)


if __name__ == "__main__":
    main()
