"""SGLang's capture-only mode (0.5.23 on): the target captures EAGLE-3 aux hidden
states and returns them to requests, with no draft loaded.

Switched on by ``--enable-return-aux-hidden-states --speculative-algorithm EAGLE3``
(the algorithm then only names the capture convention and is reset to none), the
ids by ``--return-aux-hidden-state-layer-ids A B C``. Read in the 0.5.23 wheel:

* ``arg_groups/validation_hook.py handle_aux_hidden_state_capture``: refuses at
  start-up a draft path, ``pp_size != 1``, and ids that are empty, negative or
  repeated; EAGLE3 needs no ids (DFLASH / DSPARK do);
* ``model_runner_components/spec_aux_hidden_state.py
  _resolve_capture_only_aux_hidden_state``: refuses ids ``>= num_hidden_layers``
  (times ``num_loops``), then hands them (None when absent) to
  ``eagle_aux_hidden_state_layer_ids``;
* ``model_runner_components/attention_backend_setup.py
  configure_aux_hidden_state_capture``: ``model.set_eagle3_layers_to_capture(ids)``
  -- the target class's own method, as for a draft's ids: the same id rule
  (DeepseekV2: +1 when ids[0] == 1; Llama and most others: +1 to every id), the
  model's defaults when absent; a class without the method stops the start
  (ValueError);
* ``layers/logits_processor.py _check_aux_hidden_states``: the first forward
  raises when the model captured another count than the ids name.

No draft config is read: the draft's own ids never reach SGLang in this mode.
"""

from typing import Optional, Sequence

from eagle_capture.layer_ids import engine_facts
from eagle_capture.layer_ids.lines import NEWEST_READ, CapturePlanError, SGLangLine, parse_version

FLAG = "--enable-return-aux-hidden-states"
IDS_FLAG = "--return-aux-hidden-state-layer-ids"


def line() -> SGLangLine:
    """The releases read that have the mode (the engine facts' ``capture_only``, read in
    each wheel's server arguments), as a line: the 0.5.18+ loops (the packer; layer 0 the
    embedding)."""
    have = engine_facts.capture_only_releases()
    if not have:
        raise CapturePlanError(f"no SGLang release read has {FLAG}")
    first = parse_version(have[0])
    return SGLangLine(
        f"{have[0]}{'+' if len(have) == 1 else ' - ' + have[-1]} capture-only",
        tuple(have),
        first,
        NEWEST_READ,
        shift_always=False,
        layer0="embedding",
        missing_capture="error",
    )


def line_for(sglang_version: Optional[str]) -> SGLangLine:
    """The capture-only line, refused for a release without the mode."""
    mode = line()
    if sglang_version and parse_version(sglang_version) < mode.first:
        raise CapturePlanError(
            f"SGLang {sglang_version} has no {FLAG} (the capture-only mode "
            f"came in {mode.read_versions[0]}): --capture return-aux needs "
            f"{mode.read_versions[0]} or later"
        )
    return mode


def refusal(ids: Optional[Sequence[int]], num_layers: int, pp: int = 1) -> Optional[str]:
    """SGLang's own start-up refusal for this mode, in its words, or None."""
    if pp != 1:
        return (
            f"{FLAG} only supports pp_size == 1: the capture hooks only see the layers on "
            f"the last pipeline rank"
        )
    if ids is None:
        return None
    ids = list(ids)
    if not ids:
        return f"{IDS_FLAG} must not be empty"
    if any(i < 0 for i in ids):
        return f"{IDS_FLAG} must be non-negative, got {ids}"
    if len(set(ids)) != len(ids):
        return f"{IDS_FLAG} must not repeat a layer, got {ids}"
    out = [i for i in ids if i >= num_layers]
    if out:
        return f"{IDS_FLAG} {out} out of range for a target with {num_layers} layers"
    return None


def usable(ids: Optional[Sequence[int]], num_layers: int) -> bool:
    """Whether SGLang starts with these ids (for a fix the doctor proposes)."""
    return ids is not None and refusal(ids, num_layers) is None


def flag(ids: Sequence[int]) -> str:
    return f"{IDS_FLAG} {' '.join(map(str, ids))}"
