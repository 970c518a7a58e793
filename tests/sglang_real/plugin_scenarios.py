"""The SGLang plugin (``eagle_capture.integrations.sglang.plugin``) inside the REAL SGLang code.

Each scenario loads plugins with the wheel's own ``load_plugins()`` (which finds
our entry point in the installed package metadata), so the hook lands on the
wheel's own function through its own ``HookRegistry``; the model is built by
SGLang's own classes (harness.py) WITHOUT ``set_eagle3_layers_to_capture``, and
the wheel's own configure step -- ``configure_aux_hidden_state_capture``
(0.5.18+) or ``ModelRunner.init_aux_hidden_state_capture`` (0.5.13) -- then sets
the layers and, through the hook, installs the fused capture. SGLang's own
capture on a second model built the same way is the reference. The comparison
is of SGLang's own ``LogitsProcessorOutput`` (logits and the aux hidden states
the draft receives).

0.5.9 has no plugin system: each scenario reports a skip there.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import types
from typing import Optional

import torch

from tests.sglang_real import harness

NUM_LAYERS = 7
HIDDEN = 64
DRAFT_IDS = [1, 3, 5]  # SpecForge ids -> SGLang layers [2, 4, 6]


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[int, str]] = []

    def emit(self, record):
        self.lines.append((record.levelno, record.getMessage()))

    def text(self, level=logging.DEBUG) -> str:
        return "\n".join(msg for lvl, msg in self.lines if lvl >= level)


def _has_plugins() -> bool:
    return importlib.util.find_spec("sglang.srt.plugins") is not None


def _target():
    """(module, attribute holder, name) of this line's hook point."""
    from eagle_capture.integrations.sglang.plugin import hook_target

    dotted = hook_target()
    module_name, attr = dotted.rsplit(".", 1)
    if module_name.endswith(".ModelRunner"):
        module = importlib.import_module(module_name.rsplit(".", 1)[0])
        return module, module.ModelRunner, attr
    module = importlib.import_module(module_name)
    return module, module, attr


def _rebind(old, new) -> None:
    """Every module-level binding of ``old`` -> ``new``."""
    import sys

    for m in list(sys.modules.values()):
        if isinstance(m, types.ModuleType):
            for a, v in list(vars(m).items()):
                if v is old:
                    setattr(m, a, new)


@contextlib.contextmanager
def plugins_loaded(target=None, **env):
    """The wheel's own load_plugins() with ``env`` set; afterwards the hook point
    and every module binding of it are restored (load_plugins runs once per
    process by design: its guard and registry are reset for each scenario).
    ``target``: the (module, holder, name) to restore, when the scenario breaks it."""
    import sglang.srt.plugins as plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    # The scheduler imports the model runner before it loads plugins; the hook
    # registry must then rebind the name the runner imported.
    importlib.import_module("sglang.srt.model_executor.model_runner")
    module, holder, name = target or _target()
    original = holder.__dict__.get(name)
    saved_env = {k: os.environ.get(k) for k in env}
    records = _Records()
    log = logging.getLogger("eagle_capture")
    log.addHandler(records)
    log.setLevel(logging.DEBUG)
    os.environ.update({k: str(v) for k, v in env.items() if v is not None})
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
    plugins._plugins_loaded = False
    HookRegistry.reset()
    try:
        plugins.load_plugins()
        yield records
    finally:
        log.removeHandler(records)
        if original is not None:
            hooked = holder.__dict__.get(name)
            setattr(holder, name, original)
            if hooked is not original:
                _rebind(hooked, original)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        plugins._plugins_loaded = False
        HookRegistry.reset()


def configure(model, draft_ids=DRAFT_IDS, eagle3=True):
    """What SGLang's model runner does at the hook point, calling the wheel's own
    (hooked) function: 0.5.18+ the module function, 0.5.13 the ModelRunner method
    on a namespace holding the attributes it reads."""
    module, holder, name = _target()
    fn = getattr(holder, name)
    if holder is module:
        fn(
            model=model,
            eagle_use_aux_hidden_state=eagle3,
            eagle_aux_hidden_state_layer_ids=draft_ids,
            **{
                k: v
                for k, v in dict(
                    dflash_use_aux_hidden_state=False, dflash_target_layer_ids=None, is_dspark=False
                ).items()
                if k in _params(fn)
            },
        )
    else:
        runner = types.SimpleNamespace(
            model=model,
            eagle_use_aux_hidden_state=eagle3,
            eagle_aux_hidden_state_layer_ids=draft_ids,
            dflash_use_aux_hidden_state=False,
            is_draft_worker=False,
        )
        fn(runner)


def _params(fn) -> set:
    import inspect

    return set(inspect.signature(inspect.unwrap(fn)).parameters)


def _build(
    arch="DeepseekV3ForCausalLM", dtype=torch.float32, set_capture=False, capture_ids=DRAFT_IDS
):
    """SGLang's own model (with SGLang's own LogitsProcessor, as every harness
    model) without the capture set: the wheel's configure step sets it."""
    return harness.build_model(
        num_layers=NUM_LAYERS,
        hidden_size=HIDDEN,
        dtype=dtype,
        capture_ids=capture_ids,
        seed=3,
        arch=arch,
        set_capture=set_capture,
    )


def _run(model, num_tokens, mode="extend", seed=0):
    """(next-token logits, the aux hidden states) of SGLang's LogitsProcessorOutput,
    in FULL capture mode as the EAGLE-3 target runs."""
    out = harness.run(model, harness.make_batch(model, num_tokens, mode, seed=seed)).output
    aux = out.hidden_states
    return out.next_token_logits.clone(), None if aux is None else aux.clone()


def _same_as_sglang(ours, ref, cases=((5, "extend"), (1, "decode"), (3, "decode"), (11, "extend"))):
    for num_tokens, mode in cases:
        final_ref, aux_ref = _run(ref, num_tokens, mode, seed=num_tokens)
        final, aux = _run(ours, num_tokens, mode, seed=num_tokens)
        assert aux is not None and aux_ref is not None and aux.shape == aux_ref.shape, (
            f"T={num_tokens}: aux {None if aux is None else tuple(aux.shape)} vs SGLang's"
        )
        assert torch.equal(aux, aux_ref), f"T={num_tokens} {mode}: aux differs from SGLang's"
        assert torch.equal(final, final_ref), f"T={num_tokens} {mode}: logits differ"


def _state(model):
    return harness.text_lm(model)._eagle_capture


def _skip_without_plugins():
    if not _has_plugins():
        return {
            "skip": f"SGLang {harness.sglang_version()} has no plugin system "
            f"(sglang.srt.plugins, from 0.5.13): the manual install applies"
        }
    return None


# ----------------------------------------------------------------- scenarios


def plugin_installs(arch: str):
    """Discovered by the wheel's load_plugins() (our entry point), hooked on the
    wheel's own configure step, installed on SGLang's own ``arch`` model built from
    a tiny config: captures equal SGLang's own, on the fused kernel; the log says so."""
    skip = _skip_without_plugins()
    if skip:
        return skip
    from eagle_capture.integrations.sglang.dropin import WrongCaptureLayers

    if (
        arch == "KimiK25ForConditionalGeneration"
        and importlib.util.find_spec("sglang.srt.models.kimi_k25") is None
    ):
        return {"skip": f"SGLang {harness.sglang_version()} has no kimi_k25.py"}
    ref, ours = _build(arch), _build(arch)
    with plugins_loaded(
        EAGLE_CAPTURE="1", SGLANG_PLUGINS="eagle_capture", EAGLE_CAPTURE_MAX_TOKENS="16"
    ) as log:
        module, holder, name = _target()
        assert hasattr(getattr(holder, name), "__wrapped__"), "the hook did not land"
        mr = importlib.import_module("sglang.srt.model_executor.model_runner")
        if holder is module:  # the model runner calls the name it imported: rebound too
            assert getattr(mr, name) is getattr(module, name), (
                "model_runner still calls the unhooked configure_aux_hidden_state_capture"
            )
        configure(ours, DRAFT_IDS)
        state = _state(ours)
        # SGLang may run its configure step again (a second init of the attention
        # backends): the same layers, here in another order ([6, 4, 2]: ids[0] != 1,
        # taken as capture layers), keep the installed capture and turn SGLang's own
        # off again; other layers refuse (the buffer and graphs are built for the first).
        configure(ours, [6, 4, 2])
        assert _state(ours) is state and "set again by SGLang" in log.text(logging.INFO)
        try:
            configure(ours, [1, 2, 4])
        except WrongCaptureLayers as e:
            assert "restart the server" in str(e) and "[2, 3, 5]" in str(e), e
        else:
            raise AssertionError("other layers set again were accepted")
        configure(ours, DRAFT_IDS)  # back to the installed layers
    configure(ref, DRAFT_IDS)  # unhooked again: SGLang's own capture
    lm = harness.text_lm(ours)
    assert lm.model.layers_to_capture == [] and not lm.capture_aux_hidden_states
    assert state.layer_ids == [2, 4, 6] and state.buffer.max_tokens == 16
    _same_as_sglang(ours, ref)
    assert state.fused_calls == 4 * 3, f"{state.fused_calls} fused captures, want 12"
    assert state.slot_residual_calls == 12, f"{state.slot_residual_calls} captures on path f"
    text = log.text(logging.INFO)
    assert "fused EAGLE-3 capture ON" in text and "[16, 3, 64]" in text, text
    assert "no extra write" in text and "path f" not in text, text
    out = {"log": [m for _, m in log.lines if "ON" in m]}

    # EAGLE_CAPTURE_RESIDUAL_IN_SLOT=0: path e, said in the ON line; another value
    # refuses to start (before anything is installed).
    path_e = _build(arch)
    with plugins_loaded(
        EAGLE_CAPTURE="1",
        SGLANG_PLUGINS="eagle_capture",
        EAGLE_CAPTURE_MAX_TOKENS="16",
        EAGLE_CAPTURE_RESIDUAL_IN_SLOT="0",
    ) as log:
        configure(path_e, DRAFT_IDS)
    _same_as_sglang(path_e, ref)
    assert _state(path_e).slot_residual_calls == 0 and _state(path_e).fused_calls == 12
    assert "copied into its slot" in log.text(logging.INFO), log.text(logging.INFO)
    bad = _build(arch)
    with plugins_loaded(
        EAGLE_CAPTURE="1",
        SGLANG_PLUGINS="eagle_capture",
        EAGLE_CAPTURE_MAX_TOKENS="16",
        EAGLE_CAPTURE_RESIDUAL_IN_SLOT="yes",
    ):
        try:
            configure(bad, DRAFT_IDS)
        except RuntimeError as e:
            assert "EAGLE_CAPTURE_RESIDUAL_IN_SLOT must be 1" in str(e), e
        else:
            raise AssertionError("EAGLE_CAPTURE_RESIDUAL_IN_SLOT='yes' was accepted")
    assert not hasattr(harness.text_lm(bad), "_eagle_capture")
    out["residual_in_slot_0"] = "path e"
    return out


def plugin_off_and_broken():
    """Off unless EAGLE_CAPTURE=1 (one line, no hook); not applicable on a runner
    without EAGLE-3; a hook point missing from SGLang (the target broken on
    purpose) is one ERROR line and SGLang's own capture stays."""
    skip = _skip_without_plugins()
    if skip:
        return skip
    from sglang.srt.plugins.hook_registry import HookRegistry

    out = {}
    with plugins_loaded(EAGLE_CAPTURE=None, SGLANG_PLUGINS="eagle_capture") as log:
        assert not HookRegistry._hooks, "hooks registered while off"
        model = _build()
        configure(model)
        assert not hasattr(harness.text_lm(model), "_eagle_capture")
        assert "off (EAGLE_CAPTURE=1" in log.text(), log.text()
    out["off"] = "one line, SGLang's own capture"
    with plugins_loaded(EAGLE_CAPTURE="1", SGLANG_PLUGINS="eagle_capture"):
        model = _build()
        configure(model, eagle3=False)  # the draft's own runner
        assert not hasattr(harness.text_lm(model), "_eagle_capture")
    out["no_eagle3"] = "nothing"
    target = _target()
    module, holder, name = target
    original = holder.__dict__[name]
    delattr(holder, name)  # an SGLang without this hook point
    try:
        with plugins_loaded(target, EAGLE_CAPTURE="1", SGLANG_PLUGINS="eagle_capture") as log:
            errors = log.text(logging.ERROR)
    finally:
        setattr(holder, name, original)
    assert "none of the hook points" in errors and "NOT installed" in errors, errors
    out["broken_target"] = errors.splitlines()[0]
    return out


def plugin_refuses_wrong_ids():
    """Draft ids SGLang would also get wrong: the server refuses to start
    (EAGLE_CAPTURE_ON_PROBLEM=refuse, the default) with the reason; with
    ``install`` it logs the problem and keeps SGLang's own capture where the fused
    one cannot be installed."""
    skip = _skip_without_plugins()
    if skip:
        return skip
    from eagle_capture.integrations.sglang.dropin import WrongCaptureLayers

    out = {}
    for ids, match in (([1, 1, 5], "more than once"), ([-1, 3, 5], "-1")):
        with plugins_loaded(EAGLE_CAPTURE="1", SGLANG_PLUGINS="eagle_capture"):
            model = _build()
            try:
                configure(model, ids)
            except WrongCaptureLayers as e:
                assert match in str(e) and "refuses to start" in str(e), str(e)
                out[str(ids)] = str(e).splitlines()[0]
            else:
                raise AssertionError(f"ids {ids}: the server was not refused")
        with plugins_loaded(
            EAGLE_CAPTURE="1", SGLANG_PLUGINS="eagle_capture", EAGLE_CAPTURE_ON_PROBLEM="install"
        ) as log:
            model = _build()
            configure(model, ids)
            assert not hasattr(harness.text_lm(model), "_eagle_capture")
            assert "PROBLEM" in log.text(logging.ERROR)
    return out


@contextlib.contextmanager
def planted_capture_fault(bad_slot: Optional[int], corrupt=None):
    """A wrong capture planted in the drop-in's fused capture kernels (path e's
    add_rmsnorm_capture and path f's add_rmsnorm_into_slot), after the kernel:
    ``corrupt(rows)`` rewrites a captured slot's ``[T, H]`` rows in place (default:
    +1 on column 0), in slot ``bad_slot`` (None: every slot)."""
    from eagle_capture import ops

    real = {name: getattr(ops, name) for name in ("add_rmsnorm_capture", "add_rmsnorm_into_slot")}

    def planted(real_op):
        def wrong(x, residual, weight, eps, aux, slot, norm_fp32_sum=False):
            real_op(x, residual, weight, eps, aux, slot, norm_fp32_sum=norm_fp32_sum)
            if bad_slot is None or slot == bad_slot:
                rows = aux[: x.shape[0], slot]
                if corrupt is None:
                    rows[:, 0] += 1.0
                else:
                    corrupt(rows)

        return wrong

    for name, op in real.items():
        setattr(ops, name, planted(op))
    try:
        yield
    finally:
        for name, op in real.items():
            setattr(ops, name, op)


def plugin_self_check():
    """EAGLE_CAPTURE_VERIFY=N on a correct install: N log lines, all equal; then
    off. A wrong capture planted in the fused kernel's output: the layer is named,
    that forward is still served SGLang's values, and the server switches back to
    SGLang's own capture."""
    skip = _skip_without_plugins()
    if skip:
        return skip
    ref, ours = _build(), _build()
    with plugins_loaded(
        EAGLE_CAPTURE="1", SGLANG_PLUGINS="eagle_capture", EAGLE_CAPTURE_VERIFY="2"
    ):
        configure(ours)
    configure(ref)
    log = _Records()
    logging.getLogger("eagle_capture").addHandler(log)
    try:
        _same_as_sglang(ours, ref, cases=((5, "extend"), (3, "decode"), (4, "extend")))
    finally:
        logging.getLogger("eagle_capture").removeHandler(log)
    lines = [m for _, m in log.lines if m.startswith("eagle_capture verify")]
    assert len(lines) == 3 and "1/2" in lines[0] and "2/2" in lines[1], lines
    assert "bit-identical" in lines[0] and "self-check off" in lines[2], lines
    assert not _state(ours).disabled

    planted = _build()
    with plugins_loaded(
        EAGLE_CAPTURE="1", SGLANG_PLUGINS="eagle_capture", EAGLE_CAPTURE_VERIFY="3"
    ):
        configure(planted)
    records = _Records()
    logging.getLogger("eagle_capture").addHandler(records)
    try:
        with planted_capture_fault(_state(planted).buffer.slot_of(4)):
            _same_as_sglang(planted, ref, cases=((5, "extend"),))  # served SGLang's values
    finally:
        logging.getLogger("eagle_capture").removeHandler(records)
    errors = records.text(logging.ERROR)
    assert "MISMATCH" in errors and "layer 4 (slot 1)" in errors, errors
    state = _state(planted)
    assert state.disabled and harness.text_lm(planted).model.layers_to_capture == [2, 4, 6]
    fused = state.fused_calls
    _same_as_sglang(planted, ref, cases=((6, "extend"), (2, "decode")))  # SGLang's own now
    assert state.fused_calls == fused, "the fused capture still ran after the switch"
    return {"mismatch": errors.splitlines()[0][:200]}


def plugin_overflow():
    """A forward with more tokens than the buffer's rows: served from a buffer for
    that forward (equal to SGLang's capture), one warning, the persistent buffer
    untouched; the next small forward uses the persistent buffer again."""
    skip = _skip_without_plugins()
    if skip:
        return skip
    ref, ours = _build(), _build()
    configure(ref)
    with plugins_loaded(
        EAGLE_CAPTURE="1", SGLANG_PLUGINS="eagle_capture", EAGLE_CAPTURE_MAX_TOKENS="4"
    ) as log:
        configure(ours)
        state = _state(ours)
        state.buffer.aux.fill_(float("nan"))
        _same_as_sglang(ours, ref, cases=((11, "extend"),))
        assert torch.isnan(state.buffer.aux).all(), "the persistent buffer was written"
        assert state.overflow_forwards == 1 and state.overflow is None
        _same_as_sglang(ours, ref, cases=((3, "decode"),))
        assert not torch.isnan(state.buffer.aux[:3]).any()
    warnings = log.text(logging.WARNING)
    assert "exceeds the aux buffer's 4 rows" in warnings, warnings
    return {"warning": warnings.splitlines()[0][:160]}


def plugin_server_args():
    """What the plugin reads of this line's server: SGLang's own resolved limits
    (the wheel's ServerArgs / runtime-context bags), and with no hidden states
    returned, the draft handed the persistent buffer itself (0.5.18+; no copy). The
    return modes: plugin_return_modes."""
    skip = _skip_without_plugins()
    if skip:
        return skip
    from eagle_capture.integrations.sglang.server_modes import server_args
    from eagle_capture.integrations.sglang.sizing import read_limits

    args = server_args()
    limits = read_limits(args)
    assert limits.max_prefill_tokens == args.max_prefill_tokens == 16384, limits

    plain = _build()
    with plugins_loaded(
        EAGLE_CAPTURE="1", SGLANG_PLUGINS="eagle_capture", EAGLE_CAPTURE_MAX_TOKENS="16"
    ):
        configure(plain)
    aux = harness.run(plain, harness.make_batch(plain, 5)).output.hidden_states
    state = _state(plain)
    # 0.5.18+ pass the packed view through to the draft (no copy); 0.5.13's
    # LogitsProcessor torch.cat's the one-element list (a copy).
    assert _shares_buffer(aux, state) == state.packed_tensor and not state.copy_out, (
        state.packed_tensor,
        state.copy_out,
    )
    return {"limits": str(limits)}


# The server's hidden-state return modes (its command line, as ServerArgs fields):
# (name, fields, the mode SGLang resolves, capture-only). A mode whose fields this
# line does not have is reported as such.
RETURN_MODES = (
    ("off", {}, None, False),
    ("legacy_flag", {"enable_return_hidden_states": True}, "full", False),
    ("mode_full", {"return_hidden_states_mode": "full"}, "full", False),
    ("mode_last", {"return_hidden_states_mode": "last"}, "last", False),
    (
        "capture_only",
        {"enable_return_aux_hidden_states": True, "speculative_algorithm": "EAGLE3"},
        "full",
        True,
    ),
    (
        "capture_only_last",
        {
            "enable_return_aux_hidden_states": True,
            "speculative_algorithm": "EAGLE3",
            "return_hidden_states_mode": "last",
        },
        "last",
        True,
    ),
)


def _server_fields() -> set:
    import dataclasses

    from sglang.srt.server_args import ServerArgs

    names = getattr(ServerArgs, "__struct_fields__", None)
    return set(names) if names is not None else {f.name for f in dataclasses.fields(ServerArgs)}


@contextlib.contextmanager
def served_with(**fields):
    """This process's SGLang published as a server started with ``fields`` (its command
    line), resolved by SGLang's own code: 0.5.18+ ``ServerArgs`` resolution
    (``__post_init__``; 0.5.20+ ``resolve_once``, which keeps the command line on the
    record and the decisions in its declaration stash) and the runtime context's own
    ``set_server_args`` (the bags SGLang's code reads), restored afterwards as
    SGLang's ``override_server_args`` restores them; <= 0.5.13 the global the
    scheduler sets (``set_global_server_args_for_scheduler``)."""
    from sglang.srt import server_args as sa_module

    args = sa_module.ServerArgs(model_path="dummy", device="cpu", **fields)
    if hasattr(args, "resolve_once"):
        args.resolve_once()
    rc = importlib.util.find_spec("sglang.srt.runtime_context") and importlib.import_module(
        "sglang.srt.runtime_context"
    )
    ctx = rc.get_context() if rc and hasattr(rc, "get_context") else None
    if ctx is None or not hasattr(ctx, "set_server_args"):
        previous = sa_module.get_global_server_args()
        sa_module.set_global_server_args_for_scheduler(args)
        try:
            yield args
        finally:
            sa_module.set_global_server_args_for_scheduler(previous)
        return
    saved = {
        k: getattr(ctx, k)
        for k in ("_server_args", "_config_bags", "_overrides_log", "_publish_role")
        if hasattr(ctx, k)
    }
    parallel_config = ctx.parallel._config
    compile_flag = ctx.flags.capture.enable_torch_compile
    ctx.set_server_args(args)
    try:
        yield args
    finally:
        for k, v in saved.items():
            setattr(ctx, k, v)
        ctx.parallel._config = parallel_config
        ctx.flags.capture.enable_torch_compile = compile_flag


def _capture_only_ids(args, num_layers: int):
    """The ids 0.5.23's model runner hands its configure step in capture-only mode:
    SGLang's own ``resolve_spec_aux_hidden_state_config`` (no draft, the published
    ``--return-aux-hidden-state-layer-ids``), as ``ModelRunner.init_spec_aux_hidden_state``
    calls it."""
    from sglang.srt.model_executor.model_runner_components.spec_aux_hidden_state import (
        resolve_spec_aux_hidden_state_config,
    )
    from sglang.srt.runtime_context import get_spec
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    model_config = types.SimpleNamespace(
        hf_text_config=types.SimpleNamespace(num_hidden_layers=num_layers)
    )
    config = resolve_spec_aux_hidden_state_config(
        server_args=args,
        model_config=model_config,
        spec_algorithm=SpeculativeAlgorithm.from_string(get_spec().speculative_algorithm),
        is_draft_worker=False,
    )
    assert config.eagle_use_aux_hidden_state and config.draft_kv_num_layers is None, config
    return config.eagle_aux_hidden_state_layer_ids


def sglang_host_copy(out, num_rows: int):
    """What SGLang's scheduler hands a response: its own ``GenerationBatchResult.copy_to_cpu``
    (queued on a copy stream the next forward does not wait for, 0.5.18+) on this
    forward's LogitsProcessorOutput, as for a batch whose requests asked for hidden
    states. On CPU the device-to-host copy is the tensor itself (``_async_d2h`` /
    ``async_d2h`` of a CPU tensor): the copy that has not run yet when the next forward
    writes -- the race, made deterministic."""
    from sglang.srt.managers.utils import GenerationBatchResult

    result = GenerationBatchResult(
        logits_output=out, next_token_ids=torch.zeros(num_rows, dtype=torch.int64)
    )
    result.copy_done = torch.get_device_module(
        "cpu"
    ).Event()  # the scheduler's device_module.Event()
    result.copy_to_cpu(return_logprob=False, return_hidden_states=True)
    return out.hidden_states


def _shares_buffer(tensor, state) -> bool:
    return tensor.untyped_storage().data_ptr() == state.buffer.aux.untyped_storage().data_ptr()


def plugin_return_modes():
    """Each hidden-state return mode this line has (off; --enable-return-hidden-states;
    --return-hidden-states-mode full / last; 0.5.23's capture-only
    --enable-return-aux-hidden-states, its default mode full and with last), published
    and resolved by SGLang's own code: the plugin reads the mode SGLang resolved, and
    the hidden states SGLang's host copy reads are never the plugin's persistent
    buffer -- after SGLang's own copy_to_cpu of a response's LogitsProcessorOutput,
    the next forward (which overwrites the buffer) leaves them as they were, equal to
    SGLang's own capture. Off: the draft still gets the buffer itself (no copy).
    Capture-only (no draft): the ids SGLang's own resolver hands the configure step
    (its defaults; [1, 3, 5] shifted; [0, 3, 5] with the embedding output) are served
    as SGLang captures them, no start-up id check refusing a server without a draft."""
    skip = _skip_without_plugins()
    if skip:
        return skip
    fields = _server_fields()
    out, failed = {}, []
    for name, cli, mode, capture_only in RETURN_MODES:
        if not set(cli) <= fields:
            out[name] = f"not on SGLang {harness.sglang_version()}"
            continue
        # Capture-only: SGLang's defaults (no ids), ids shifted (ids[0] == 1) and the
        # embedding output (0); a draft deployment: the draft's ids.
        id_cases = (
            [None, [1, 3, 5], [0, 3, 5]]
            if name == "capture_only"
            else [None]
            if capture_only
            else [DRAFT_IDS]
        )
        out[name] = []
        for layer_ids in id_cases:  # every case runs: a failure names each one
            try:
                out[name].append(_return_mode(name, cli, mode, capture_only, layer_ids))
            except Exception as e:  # noqa: BLE001 - reported together below
                failed.append(f"{name} (ids {layer_ids}): {type(e).__name__}: {e}")
    if "enable_return_aux_hidden_states" in fields:
        # Capture-only ids whose shift names a layer past the last one ([1, 3, 6] ->
        # [2, 4, 7] of 7): no draft to protect, so no refusal -- SGLang's own capture
        # stays (and fails its own first forward there), with one warning.
        past_end = [1, 3, NUM_LAYERS - 1]
        with served_with(
            enable_return_aux_hidden_states=True,
            speculative_algorithm="EAGLE3",
            return_aux_hidden_state_layer_ids=past_end,
        ) as args:
            model = _build()
            with plugins_loaded(EAGLE_CAPTURE="1", SGLANG_PLUGINS="eagle_capture") as log:
                configure(model, _capture_only_ids(args, NUM_LAYERS))
            try:
                harness.run(model, harness.make_batch(model, 5))
                own = "no error"
            except Exception as e:  # noqa: BLE001 - SGLang's own error is the expected outcome
                own = f"{type(e).__name__}: {e}"
        lm = harness.text_lm(model)
        warned = log.text(logging.WARNING)
        if (
            hasattr(lm, "_eagle_capture")
            or "not installed (capture-only mode" not in warned
            or lm.model.layers_to_capture != [2, 4, NUM_LAYERS]
            or own == "no error"
        ):
            failed.append(
                f"capture_only (ids {past_end}): installed, refused or served: "
                f"{lm.model.layers_to_capture} {own} {log.text()}"
            )
        out["capture_only_past_the_last_layer"] = {
            "plugin": warned.splitlines()[:1],
            "SGLang's first forward": own,
        }
    assert not failed, "\n".join(failed)
    return out


def _return_mode(name, cli, mode, capture_only, layer_ids) -> str:
    """One server of RETURN_MODES (``layer_ids``: the draft's, or capture-only's
    --return-aux-hidden-state-layer-ids): what plugin_return_modes checks."""
    from eagle_capture.integrations.sglang import server_modes

    extra = (
        {}
        if layer_ids is None or not capture_only
        else {"return_aux_hidden_state_layer_ids": layer_ids}
    )
    with served_with(**cli, **extra) as args:
        # What SGLang's runtime says, and SGLang's rule on the published record (what
        # the plugin reads where no runtime context answers).
        assert (
            server_modes.return_hidden_states_mode()
            == mode
            == server_modes.return_mode_of_args(args)
        ), (
            name,
            server_modes.return_hidden_states_mode(),
            server_modes.return_mode_of_args(args),
            mode,
        )
        assert (
            (server_modes.aux_capture_only() is not None)
            == capture_only
            == (server_modes.capture_only_of_args(args) is not None)
        ), name
        ids = _capture_only_ids(args, NUM_LAYERS) if capture_only else layer_ids
        # Built here: 0.5.23's LogitsProcessor reads capture-only mode when built.
        ref, ours = _build(), _build()
        with plugins_loaded(
            EAGLE_CAPTURE="1", SGLANG_PLUGINS="eagle_capture", EAGLE_CAPTURE_MAX_TOKENS="16"
        ) as log:
            configure(ours, ids)
        configure(ref, ids)
        state = _state(ours)
        assert state.layer_ids == sorted(harness.text_lm(ref).model.layers_to_capture)
        # The target's forwards: FULL (EAGLE-3 extend / verify; capture-only in
        # mode full); capture-only in mode last: LAST, whose decodes pass the
        # packed aux through as it is.
        batch_mode, capture, rows = (
            ("decode", "last", 3) if mode == "last" and capture_only else ("extend", "full", 5)
        )

        def forward(model, seed):
            return harness.run(
                model, harness.make_batch(model, rows, batch_mode, seed=seed, capture=capture)
            ).output

        first, first_ref = forward(ours, 1), forward(ref, 1)
        assert torch.equal(first.hidden_states, first_ref.hidden_states), (
            f"{name} ids {ids}: not what SGLang's own capture returns"
        )
        if mode is None:
            # No request may ask for hidden states: no host copy of them, and
            # the draft reads the buffer itself (0.5.18+), no copy made.
            assert not state.copy_out, f"{name}: a copy per forward for nothing"
            assert _shares_buffer(first.hidden_states, state) == state.packed_tensor
            return (
                "no copy (the draft reads the buffer)"
                if state.packed_tensor
                else "no copy of ours (0.5.13's LogitsProcessor torch.cat's)"
            )
        host = sglang_host_copy(first, rows)
        kept = host.clone()
        forward(ours, 2)  # overwrites the persistent buffer's rows
        assert torch.equal(host, kept), (
            f"{name}: the hidden states SGLang's asynchronous host copy reads were "
            f"overwritten by the next forward (the plugin handed it its persistent "
            f"buffer; mode {mode})"
        )
        assert not _shares_buffer(host, state), f"{name}: the buffer reached the host copy"
        assert state.copy_out == state.packed_tensor, (name, state.copy_out)
        text = log.text(logging.INFO)
        assert "fused EAGLE-3 capture ON" in text, text
        if capture_only:
            assert "capture-only mode" in text and "PROBLEM" not in log.text(), text
        return f"ids {ids} -> layers {state.layer_ids}: " + (
            "a copy per forward"
            if state.copy_out
            else "the LogitsProcessor's own copy (0.5.13: torch.cat)"
        )


# The start-up id check on other EAGLE-3 targets: (architecture, model file) whose
# set_eagle3_layers_to_capture a shell can run (as scenarios.model_id_rules does).
CHECKED_TARGETS = (
    ("LlamaForCausalLM", "llama"),
    ("Qwen3MoeForCausalLM", "qwen3_moe"),
    ("GptOssForCausalLM", "gpt_oss"),
)


def _shell_target(arch: str, module_name: str, num_layers: int = 40):
    """A stand-in target named ``arch`` whose set_eagle3_layers_to_capture is the
    wheel's own (the config, pipeline group and text model it reads)."""
    module = importlib.import_module(f"sglang.srt.models.{module_name}")
    method = getattr(module, arch).set_eagle3_layers_to_capture

    class TextModel:
        layers_to_capture = None
        layers = [None] * num_layers

        def set_eagle3_layers_to_capture(self, layer_ids):  # qwen3_moe delegates
            self.layers_to_capture = list(layer_ids)

    shell = type(arch, (), {"set_eagle3_layers_to_capture": method})()
    shell.config = types.SimpleNamespace(num_hidden_layers=num_layers, hidden_size=64)
    shell.pp_group = types.SimpleNamespace(is_last_rank=True)
    shell.model = TextModel()
    shell.capture_aux_hidden_states = False
    return shell


def plugin_checks_every_target():
    """The plugin's start-up id check on Llama, Qwen3-MoE and GPT-OSS targets (the
    wheel's own set_eagle3_layers_to_capture and configure step): the layers SGLang
    set against the draft's trainer convention, read from its config.json. Right:
    served by SGLang's own capture (the shell is not the model's loop: no adapter
    applies; plugin_families installs on the real classes); wrong under every
    reading: refused with the ids to write; ambiguous: a warning."""
    skip = _skip_without_plugins()
    if skip:
        return skip
    import tempfile

    from eagle_capture.integrations.sglang import server_modes
    from eagle_capture.integrations.sglang.dropin import WrongCaptureLayers

    def draft(folder, config):
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "config.json"), "w") as f:
            json.dump(config, f)
        return types.SimpleNamespace(
            speculative_draft_model_path=folder, speculative_draft_model_revision=None
        )

    specforge = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [1, 19, 36],
            "use_aux_hidden_state": True,
        },
    }
    speculators = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_config": {"algorithm": "eagle3"},
        "eagle_aux_hidden_state_layer_ids": [5, 10, 15],
    }
    modelopt = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [1, 19, 36],
            "next_layer_regular": True,
            "parallel_draft_step": 1,
        },
    }
    out, saved = {}, server_modes.server_args
    work = tempfile.mkdtemp(prefix="eagle_checks_")
    try:
        for arch, module_name in CHECKED_TARGETS:
            got = {}
            for case, config, env, expect in (
                ("specforge", specforge, {}, "ok"),
                (
                    "specforge_told_input",
                    specforge,
                    {"EAGLE_CAPTURE_ID_CONVENTION": "input"},
                    "refused",
                ),
                ("modelopt", modelopt, {}, "ambiguous"),
                ("speculators_top_level", speculators, {}, "refused"),
            ):
                args = draft(os.path.join(work, f"{arch}_{case}"), config)
                server_modes.server_args = lambda: args
                ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                model = _shell_target(arch, module_name)
                with plugins_loaded(
                    EAGLE_CAPTURE="1", SGLANG_PLUGINS="eagle_capture", **env
                ) as log:
                    try:
                        configure(model, ids)
                    except WrongCaptureLayers as e:
                        got[case] = ("refused", str(e))
                    else:
                        text = log.text(logging.INFO)
                        status = (
                            "ambiguous"
                            if "layer ids AMBIGUOUS" in text
                            else "ok"
                            if "what the draft was trained on" in text
                            else "?"
                        )
                        assert "SGLang's own capture serves this model" in text, text
                        got[case] = (status, text)
                assert model.capture_aux_hidden_states, f"{arch} {case}: SGLang's capture off"
                assert got[case][0] == expect, (arch, case, got[case])
            # The refusals name the ids to write, by this model's own rule.
            told = got["specforge_told_input"][1]
            assert "eagle_config.eagle_aux_hidden_state_layer_ids = [1, 19, 36]" in told, told
            top = got["speculators_top_level"][1]
            assert "speculators" in top and "[5, 10, 15]" in top, top
            out[arch] = {case: status for case, (status, _) in got.items()}
    finally:
        server_modes.server_args = saved
    return out


def plugin_installs_families():
    """Every family adapter through the plugin, on the wheel's own model of each
    family (family_models: Llama, Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE, GPT-OSS,
    GLM-4 MoE, MiniMax-M2): discovered by load_plugins(), hooked on the configure
    step, "fused EAGLE-3 capture ON ... <family> family" logged, and what the draft
    receives equal to SGLang's own capture on the fused kernel."""
    skip = _skip_without_plugins()
    if skip:
        return skip
    from tests.sglang_real import family_models

    out = {}
    for family in family_models.FAMILIES:
        ref = family_models.build(family, set_capture=False)
        ours = family_models.build(family, set_capture=False)
        with plugins_loaded(
            EAGLE_CAPTURE="1", SGLANG_PLUGINS="eagle_capture", EAGLE_CAPTURE_MAX_TOKENS="16"
        ) as log:
            configure(ours, DRAFT_IDS)
        configure(ref, DRAFT_IDS)  # unhooked: SGLang's own capture
        state = ours._eagle_capture
        text = log.text(logging.INFO)
        on = [m for _, m in log.lines if "fused EAGLE-3 capture ON" in m]
        assert len(on) == 1 and f"{state.family.name} family" in on[0] and "[16, 3, 64]" in on[0], (
            family,
            text,
        )
        assert ours.model.layers_to_capture == [] and not ours.capture_aux_hidden_states
        _same_as_sglang(ours, ref)
        assert state.fused_calls == 4 * 3, f"{family}: {state.fused_calls} fused captures"
        out[family] = on[0]
    return out


SCENARIOS = {
    "plugin_deepseek_v3": lambda: plugin_installs("DeepseekV3ForCausalLM"),
    "plugin_families": plugin_installs_families,
    "plugin_kimi_k25": lambda: plugin_installs("KimiK25ForConditionalGeneration"),
    "plugin_off_and_broken": plugin_off_and_broken,
    "plugin_refuses_wrong_ids": plugin_refuses_wrong_ids,
    "plugin_self_check": plugin_self_check,
    "plugin_overflow": plugin_overflow,
    "plugin_server_args": plugin_server_args,
    "plugin_return_modes": plugin_return_modes,
    "plugin_checks_every_target": plugin_checks_every_target,
}
