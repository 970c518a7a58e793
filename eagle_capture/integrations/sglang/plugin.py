"""SGLang plugin: the fused EAGLE-3 capture, switched on through SGLang's own
extension point in every scheduler (TP) process -- no edit of SGLang.

    pip install eagle-capture
    EAGLE_CAPTURE=1 python -m sglang.launch_server --model-path <Kimi-K2.5> --tp 8 \\
        --speculative-algorithm EAGLE3 --speculative-draft-model-path <draft> ...

``register`` is the entry point ``eagle_capture`` of group ``sglang.srt.plugins``
(setup.py). SGLang's ``load_plugins()`` calls it in the launcher and in every
scheduler process (``run_scheduler_process``; the engine starts those with
``spawn``, so only a plugin reaches the model there). SGLang's
``SGLANG_PLUGINS`` whitelist applies as usual. Installing the package changes
nothing by itself: ``EAGLE_CAPTURE=1`` turns it on (SGLang loads every installed
plugin when ``SGLANG_PLUGINS`` is unset).

The moment, per line (read in the wheels): right after the target's layers to
capture are set and before any CUDA graph is captured --

* 0.5.18 - 0.5.23: an AFTER hook on ``attention_backend_setup.
  configure_aux_hidden_state_capture`` (``ModelRunner.init_attention_backends``
  calls it before ``init_all_cuda_graphs``; SGLang's hook registry rebinds the
  name in ``model_runner`` too);
* 0.5.13: an AFTER hook on ``ModelRunner.init_aux_hidden_state_capture``
  (``initialize``, before ``init_device_graphs``);
* 0.5.9 has no plugin system: call :func:`eagle_capture.integrations.sglang.dropin.install_eagle3_capture`
  by hand (README).

At the hook, on each rank: nothing on a runner without EAGLE-3 (the draft's own
runner, another algorithm) or on a pipeline stage that captures nothing; one
log line and SGLang's own capture for what the fused capture does not handle
(another architecture, two-batch overlap, ...); a refusal to start
(``EAGLE_CAPTURE_ON_PROBLEM=refuse``, the default) when the layer ids would hand
the draft something it was not trained on -- which SGLang's own capture would do
too -- with the doctor's explanation; ``EAGLE_CAPTURE_ON_PROBLEM=install``
installs anyway where it can and logs the problem as an error. Otherwise the
install, sized from the server's arguments (:mod:`eagle_capture.integrations.sglang.sizing`),
and one log line saying what runs.

``EAGLE_CAPTURE_FUSED_ALLREDUCE=1`` (TP > 1, opt-in): where SGLang would fuse a
captured layer's deferred all-reduce into its input norm, the drop-in runs it
(the one kernel on SGLang's TP group or SGLang's all-reduce + the fused op, per T
from ``EAGLE_CAPTURE_ALLREDUCE_TABLE``): :mod:`eagle_capture.integrations.sglang.allreduce`.

Responses with hidden states (any return mode SGLang resolves: ``--enable-return-hidden-states``,
``--return-hidden-states-mode last|full``, 0.5.23's capture-only
``--enable-return-aux-hidden-states``): SGLang copies them to the host asynchronously, so the
LogitsProcessor gets a copy of the captures each forward, never the buffer
(:func:`eagle_capture.integrations.sglang.server_modes.return_hidden_states_mode`). Capture-only
mode loads no draft: the fused capture installs on the layers SGLang set (the embedding output
included) without the draft's checks.

``EAGLE_CAPTURE_VERIFY=N``: the first N eager forwards also run SGLang's own norm
on copies and compare (captures bit-exact, normed output within rounding), check
that every TP rank holds the same captures, log a line per forward, and switch
the server back to SGLang's own capture on a mismatch. Off: no cost.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from typing import Any, Optional

from eagle_capture.integrations.core.log import rank_or_unknown
from eagle_capture.integrations.settings import (
    MAX_TOKENS,
    ON_PROBLEM,
    SWITCH,
    PluginError,
    fused_allreduce,
    on_problem,
    verify_forwards,
)
from eagle_capture.integrations.settings import switch_on as _switch_on

logger = logging.getLogger("eagle_capture")

RESIDUAL_IN_SLOT = "EAGLE_CAPTURE_RESIDUAL_IN_SLOT"  # 1 (default): residual-in-slot; 0: slot-copy

# Where each SGLang line sets the layers to capture (module, attribute path).
HOOK_POINTS = (
    (
        "sglang.srt.model_executor.model_runner_components.attention_backend_setup",
        "configure_aux_hidden_state_capture",
    ),  # 0.5.18 - 0.5.23
    (
        "sglang.srt.model_executor.model_runner",
        "ModelRunner.init_aux_hidden_state_capture",
    ),  # 0.5.13
)


def hook_target() -> str:
    """The dotted path this SGLang's hook goes on; PluginError if it has none."""
    for module_name, attr_path in HOOK_POINTS:
        try:
            if importlib.util.find_spec(module_name) is None:
                continue
        except ModuleNotFoundError:
            continue
        obj = importlib.import_module(module_name)
        for part in attr_path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if obj is not None:
            return f"{module_name}.{attr_path}"
    raise PluginError(
        f"eagle_capture: this SGLang ({_sglang_version()}) has none of the hook points "
        f"{[f'{m}.{a}' for m, a in HOOK_POINTS]} (read in 0.5.13 - 0.5.23): the fused capture "
        f"is NOT installed and SGLang's own capture stays"
    )


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``): hook the install where SGLang
    sets the layers to capture. SGLang's ``load_plugins()`` only logs a
    plugin's exceptions, so every failure here is logged as one clear error."""
    try:
        if not _switch_on():
            logger.info(
                "eagle_capture: SGLang plugin loaded, off (%s=1 turns on the fused "
                "EAGLE-3 capture)",
                SWITCH,
            )
            return
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        target = hook_target()
        hook = (
            _after_init_aux
            if target.endswith("ModelRunner.init_aux_hidden_state_capture")
            else _after_configure
        )
        HookRegistry.register(target, hook, HookType.AFTER)
        logger.info(
            "eagle_capture: on (%s=1): the fused EAGLE-3 capture installs after %s", SWITCH, target
        )
    except Exception as e:  # noqa: BLE001 - SGLang would log a bare traceback
        logger.error(
            "eagle_capture: the plugin could not register, SGLang's own capture stays: %s: %s",
            type(e).__name__,
            e,
        )


# The hooks: SGLang calls them with the hooked function's result and arguments.


def _after_configure(
    result,
    *args,
    model=None,
    eagle_use_aux_hidden_state=False,
    eagle_aux_hidden_state_layer_ids=None,
    **kwargs,
):
    activate(model, eagle_use_aux_hidden_state, eagle_aux_hidden_state_layer_ids)


def _after_init_aux(result, runner, *args, **kwargs):
    if getattr(runner, "is_draft_worker", False):
        return
    activate(
        runner.model,
        getattr(runner, "eagle_use_aux_hidden_state", False),
        getattr(runner, "eagle_aux_hidden_state_layer_ids", None),
        runner=runner,
        server_args=getattr(runner, "server_args", None),
    )


# -------------------------------------------------------------------- activate


def activate(model, eagle3: bool, draft_ids, *, runner=None, server_args=None, env=os.environ):
    """Install the fused capture on ``model`` if it applies (returns the buffer),
    else log why not and return None. Raises (the server does not start) when the
    layer ids would feed the draft wrongly and ``EAGLE_CAPTURE_ON_PROBLEM`` is
    ``refuse``."""
    from eagle_capture.integrations.sglang import dropin, server_modes

    # The targets the fused capture installs on: one family adapter each (families/).
    # Every other EAGLE-3 target gets the start-up id check and keeps SGLang's own capture.
    from eagle_capture.integrations.sglang.families import FUSED_ARCHITECTURES, family_of
    from eagle_capture.integrations.sglang.sizing import describe, read_limits, size_buffer_for

    if not eagle3 or model is None:
        return None  # not the EAGLE-3 target's runner
    site = capture_site(model)
    if site is None:
        logger.warning(
            "eagle_capture: %s has no .model.layers_to_capture (or a "
            ".language_model holding one): its layer ids are not checked and "
            "SGLang's own capture stays",
            type(model).__name__,
        )
        return None
    causal_lm, num_layers, hidden = site
    path = "" if causal_lm is model else ".language_model"
    family = family_of(model, required=False)
    if family is not None:
        try:
            family.text_model_of(model)
        except TypeError as e:  # a class of a known name that is not the loop we read
            logger.warning("eagle_capture: %s", e)
            family = None
    if family is not None and dropin.reapply_after_reconfigure(model):
        logger.info(
            "eagle_capture: layers to capture set again by SGLang; the fused capture stays on"
        )
        return causal_lm._eagle_capture.buffer
    if (
        not getattr(causal_lm, "capture_aux_hidden_states", False)
        or not causal_lm.model.layers_to_capture
    ):
        logger.info("eagle_capture: this rank captures nothing (not the last pipeline stage)")
        return None
    policy = on_problem(env)
    args = server_args if server_args is not None else server_modes.server_args()
    version = _sglang_version()
    layers = list(causal_lm.model.layers_to_capture)
    # 0.5.23's --enable-return-aux-hidden-states: the target captures for its
    # responses and no draft is loaded, so there is no training to check the
    # layers against: they are the ones the user named (the embedding output,
    # layer 0, included), as SGLang set them.
    capture_only = server_modes.aux_capture_only(args) is not None

    problems = []
    if family is not None:
        try:
            dropin.check_capture_layers(
                layers,
                getattr(causal_lm.model, "start_layer", 0),
                getattr(causal_lm.model, "end_layer", num_layers),
                allow_embedding=capture_only,
                final_boundary=family.captures_final_boundary(dropin.sglang_version()),
                num_layers=len(causal_lm.model.layers),
            )
        except dropin.WrongCaptureLayers as e:
            if capture_only:  # nothing to protect: SGLang's own capture answers for it
                logger.warning(
                    "eagle_capture: not installed (capture-only mode, no draft), "
                    "SGLang's own capture stays: %s",
                    str(e).replace("eagle_capture: ", "", 1),
                )
                return None
            problems.append(str(e).replace("eagle_capture: ", "", 1))
    if capture_only:
        logger.info(
            "eagle_capture: capture-only mode (--enable-return-aux-hidden-states, no "
            "draft): SGLang set layers %s for ids %s; no draft to check them against",
            sorted(layers),
            None if draft_ids is None else list(draft_ids),
        )
    else:
        draft_config = read_draft_config(args)
        if family is not None:
            problems += draft_config_problems(draft_config, layers, hidden)
        if not problems:  # (a structural problem above already says what is wrong)
            problems += id_problems(
                layers, num_layers, draft_config, draft_ids, type(model).__name__, version, env
            )

    if problems and policy == "refuse":
        raise dropin.WrongCaptureLayers(
            "eagle_capture refuses to start this server: the draft would not receive what it "
            "was trained on (SGLang's own capture has the same problem):\n- "
            + "\n- ".join(problems)
            + f"\nFix the draft config, or set {ON_PROBLEM}=install to serve anyway"
        )
    for problem in problems:
        logger.error("eagle_capture: PROBLEM (%s=install: serving anyway): %s", ON_PROBLEM, problem)
    if family is None:
        logger.info(
            "eagle_capture: %s: layer ids checked; no family adapter has been read "
            "against its loop (fused: %s), SGLang's own capture serves this model",
            type(model).__name__,
            ", ".join(FUSED_ARCHITECTURES),
        )
        return None

    limits = read_limits(args, runner)
    try:
        sizing = size_buffer_for(limits, env)
    except ValueError as e:
        raise PluginError(f"eagle_capture: {e}") from None
    logger.debug("eagle_capture: SGLang's limits here: %s", describe(limits))
    check_memory(sizing.max_tokens * len(set(layers)) * hidden, causal_lm)
    in_slot = env.get(RESIDUAL_IN_SLOT, "1").strip()
    if in_slot not in ("0", "1"):
        raise PluginError(
            f"eagle_capture: {RESIDUAL_IN_SLOT} must be 1 (the residual lives in "
            f"the slot: no extra write) or 0 (stored in place and copied into "
            f"the slot), got {in_slot!r}"
        )
    one_kernel = fused_allreduce(env)
    try:
        buffer = dropin.install_eagle3_capture(
            model,
            sizing.max_tokens,
            allow_embedding=capture_only,
            residual_in_slot=in_slot == "1",
            fused_allreduce=one_kernel,
        )
    except dropin.WrongCaptureLayers:
        if policy == "refuse":
            raise
        logger.exception(
            "eagle_capture: not installed (%s=install), SGLang's own capture stays", ON_PROBLEM
        )
        return None
    except (dropin.UnsupportedServer, TypeError) as e:
        logger.warning("eagle_capture: not applicable here, SGLang's own capture stays: %s", e)
        return None
    state = causal_lm._eagle_capture
    _setup_verify(state, env)
    returned = server_modes.return_hidden_states_mode(args)
    if returned is not None and state.packed_tensor:
        # 0.5.18+: a response's hidden states are the LogitsProcessor output's (the
        # packed aux, all rows, in the target's FULL forwards; the view itself in
        # LAST-mode decodes), copied to the host on a side stream the next forward
        # does not wait for: the persistent buffer would be overwritten under that
        # copy. Hand SGLang a copy instead (one per forward) whenever a request may
        # ask for them ("last" or "full").
        state.copy_out = True
    nbytes = buffer.aux.numel() * buffer.aux.element_size()
    logger.info(
        "eagle_capture: fused EAGLE-3 capture ON (SGLang %s, %s%s, %s family, TP rank %s; %s): "
        "layers %s -> "
        "slots 0..%d, buffer [%d, %d, %d] %s = %.1f MiB on %s (%s); %s%s",
        version,
        type(model).__name__,
        path,
        family.name,
        _tp_rank(),
        _deployment(args, sizing),
        list(buffer.layer_ids),
        buffer.num_captures - 1,
        buffer.max_tokens,
        buffer.num_captures,
        buffer.hidden_size,
        str(buffer.aux.dtype).replace("torch.", ""),
        nbytes / 2**20,
        buffer.aux.device,
        sizing.reason,
        _capture_path(state),
        f"; self-check of the first {state.verify_total} eager forwards"
        if state.verify_total
        else "",
    )
    if state.copy_out:
        logger.info(
            "eagle_capture: responses may return hidden states (mode %s%s): the "
            "LogitsProcessor gets a copy of the captures each forward, not the "
            "buffer SGLang's asynchronous host copy would read",
            returned,
            ", capture-only" if capture_only else "",
        )
    return buffer


def capture_site(model):
    """(the causal LM whose ``.model`` holds ``layers_to_capture``, the target's layer
    count, hidden size) for any SGLang EAGLE-3 target: the model itself or its
    ``.language_model`` (multimodal wrappers); None if neither has one."""
    for holder in (model, getattr(model, "language_model", None)):
        inner = getattr(holder, "model", None)
        if inner is None or not hasattr(inner, "layers_to_capture"):
            continue
        config = getattr(holder, "config", None) or getattr(model, "config", None)
        text = getattr(config, "text_config", None) or config
        layers = getattr(text, "num_hidden_layers", None)
        if not isinstance(layers, int):
            layers = len(getattr(inner, "layers", []))
        return holder, int(layers), int(getattr(text, "hidden_size", 0) or 0)
    return None


def id_problems(
    layers,
    num_layers: int,
    draft_config: Optional[dict],
    draft_ids,
    architecture: str,
    version: str,
    env=os.environ,
) -> list[str]:
    """The start-up id check (:mod:`eagle_capture.layer_ids.startup`): the layers
    SGLang set against what the draft was trained on, in its trainer's convention.
    A problem is returned; an ambiguous or unknown answer is logged as a warning,
    a table that predicted other layers than SGLang set as one too."""
    from eagle_capture.layer_ids import startup
    from eagle_capture.layer_ids.diagnosis import fix_ids
    from eagle_capture.layer_ids.lines import IDS_KEY, CapturePlanError, line_of, parse_version
    from eagle_capture.layer_ids.rules import sglang_model_rule

    try:
        rule = sglang_model_rule(parse_version(version), architecture)
        line = line_of(version).for_model(rule)
    except (CapturePlanError, ValueError):
        rule = line = None
    if line is not None and rule is not None and draft_ids is not None:
        predicted = sorted(line.capture_layers(list(draft_ids), num_layers))
        if predicted != sorted(layers):
            logger.warning(
                "eagle_capture: the doctor's rule for %s on SGLang %s predicts layers "
                "%s for ids %s, SGLang set %s: the check below uses what SGLang set; "
                "the doctor's table needs this model re-read",
                architecture,
                version,
                predicted,
                list(draft_ids),
                sorted(layers),
            )

    def fix(expected):
        ids = fix_ids(line, expected, num_layers) if line is not None else None
        return (
            f"eagle_config.{IDS_KEY} = {ids}"
            if ids is not None
            else f"ids that make SGLang capture layers {expected} "
            f"(`eagle-capture doctor --engine sglang`)"
        )

    config = draft_config
    if config is None and draft_ids is not None:  # the config is not visible: SGLang's ids
        config = {"eagle_config": {IDS_KEY: list(draft_ids)}}
    try:
        verdict = startup.check("SGLang", layers, num_layers, config, architecture, fix, env)
    except ValueError as e:
        raise PluginError(f"eagle_capture: {e}") from None
    if verdict.status == "problem":
        return [verdict.text]
    if verdict.status == "ok":
        logger.info("eagle_capture: layer ids: %s", verdict.text)
    else:
        logger.warning("eagle_capture: layer ids %s: %s", verdict.status.upper(), verdict.text)
    return []


def check_memory(elements: int, causal_lm) -> None:
    """SGLang sized its KV pool before this point and leaves the rest of the GPU
    to activations and CUDA graphs; the buffer comes out of that headroom (the
    same bytes SGLang's own capture allocates for its largest forward, but held).
    Refuse at start-up rather than run out of memory in a graph capture later."""
    import torch

    weight = next(causal_lm.parameters(), None)
    if weight is None or not weight.is_cuda:
        return
    nbytes = elements * weight.element_size()
    free, total = torch.cuda.mem_get_info(weight.device)
    if nbytes > free // 2:
        raise PluginError(
            f"eagle_capture: the aux buffer needs {nbytes / 2**20:.0f} MiB but only "
            f"{free / 2**20:.0f} MiB of GPU memory is left after SGLang's KV pool (for "
            f"activations and CUDA graphs): lower --mem-fraction-static by about "
            f"{nbytes / total + 0.01:.2f}, or set {MAX_TOKENS}"
        )


def _deployment(args, sizing) -> str:
    """What of the deployment decides how the capture runs, in a few words."""
    try:
        from sglang.srt.distributed import get_tp_group

        tp = get_tp_group().world_size
    except Exception:  # noqa: BLE001
        tp = "?"
    rc = sys.modules.get("sglang.srt.runtime_context")
    try:
        comm = getattr(rc.get_exec(), "comm", None) if rc is not None else None
    except Exception:  # noqa: BLE001
        comm = None
    from eagle_capture.integrations.sglang.server_modes import (
        attention_tp_size,
        dp_attention_enabled,
    )

    dp_attention = dp_attention_enabled()
    backend = getattr(comm, "flashinfer_allreduce_fusion_backend", None)
    fusion = (
        backend
        if backend is not None
        else "on"
        if getattr(args, "enable_flashinfer_allreduce_fusion", False)
        else "off"
    )
    if tp == 1 or dp_attention:
        fusion = "n/a"
    graphs = (
        f"CUDA graphs up to {sizing.graph_tokens} tokens"
        if sizing.graph_tokens
        else "no CUDA graphs seen"
    )
    dp = (
        f", DP attention (attention-TP {attention_tp_size()}: each rank captures its own "
        f"requests' rows)"
        if dp_attention
        else ""
    )
    return f"TP {tp}{dp}, all-reduce fusion {fusion} (captures its reduced residual_out), {graphs}"


def _capture_path(state) -> str:
    fused = f"; {state.allreduce.describe()}" if state.allreduce is not None else ""
    if not state.residual_in_slot_enabled:
        return "residual stored in place and copied into its slot" + fused
    above = (
        f" for forwards over {state.residual_in_slot_above} tokens (smaller ones: SGLang's "
        f"all-reduce fusion size, stored in place and copied)"
        if state.residual_in_slot_above
        else ""
    )
    return f"residual written into its slot, no extra write{above}" + fused


def _setup_verify(state, env) -> None:
    n = verify_forwards(env)
    if not n:
        return
    state.start_verify(n)
    state.verify_group = _tp_group(state.buffer.aux)
    state.verify_rows_group = _attn_tp_group(state.buffer.aux)


def _attn_tp_group(like):
    """The ranks that hold the same rows (SGLang's attention-TP group: the TP group
    without DP attention, tp / dp ranks with it), when there are several; else
    None."""
    return _process_group("get_attn_tp_group", like)


def _tp_group(like):
    """SGLang's TP process group when there are several ranks, else None."""
    return _process_group("get_tp_group", like)


def _process_group(getter: str, like):
    """The torch process group of SGLang's ``parallel_state.<getter>()`` group for
    tensors like ``like`` (its device group for CUDA ones), when it has several
    ranks; else None."""
    try:
        from sglang.srt.distributed import parallel_state

        group = getattr(parallel_state, getter)()
    except Exception:  # noqa: BLE001 - outside a server
        return None
    if group.world_size <= 1:
        return None
    return group.device_group if like.is_cuda else group.cpu_group


def _tp_rank() -> Any:
    def rank():
        from sglang.srt.distributed import get_tp_group

        return get_tp_group().rank_in_group

    return rank_or_unknown(rank)


def _sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001
        return "unknown"


# ---------------------------------------------------------------- draft config


def read_draft_config(server_args) -> Optional[dict]:
    """The draft's ``config.json`` as SGLang will load it (a local folder, or the
    Hugging Face cache); None when it cannot be seen from here."""
    from eagle_capture.layer_ids.startup import find_draft_config

    return find_draft_config(
        getattr(server_args, "speculative_draft_model_path", None),
        getattr(server_args, "speculative_draft_model_revision", None),
    )


def draft_config_problems(config: Optional[dict], layers: list[int], hidden_size: int) -> list[str]:
    """The draft's input width (its fc: number of captured states x target hidden size)
    vs what the target will capture. Which layers those are is the id check's."""
    if config is None:
        logger.info(
            "eagle_capture: the draft's config.json is not visible here: its input "
            "width is not checked"
        )
        return []
    from eagle_capture.layer_ids.lines import CapturePlanError, read_draft_ids

    try:
        draft = read_draft_ids(config)
    except CapturePlanError as e:
        return [f"the draft config: {e}"]
    problems = []
    nested, top = draft.nested, draft.top_level
    # Ids only at the top level are not a problem by themselves (SGLang ignores them and
    # captures its defaults, which may be exactly the draft's layers): the start-up id
    # check (id_problems) compares what SGLang set with the draft's layers.
    # The draft's fc input, as SGLang's EAGLE-3 drafts size it: num_aux_hidden_states,
    # else the ids' count (Kimi-K2.5's draft also reads the top-level key), else 3.
    arch = (config.get("architectures") or [""])[0]
    ids = nested if nested is not None else (top if arch == "Eagle3DeepseekV2ForCausalLM" else None)
    expected = config.get("num_aux_hidden_states") or (len(ids) if ids else 3)
    target_hidden = config.get("target_hidden_size") or config.get("hidden_size")
    if expected != len(layers) or (target_hidden and target_hidden != hidden_size):
        problems.append(
            f"the draft ({arch or 'unknown architecture'}) expects {expected} x "
            f"{target_hidden} input features but the target captures {len(layers)} layers "
            f"{layers} of width {hidden_size}"
        )
    return problems
