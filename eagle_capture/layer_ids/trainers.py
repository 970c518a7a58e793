"""Which trainer exported an EAGLE-3 draft, and what its ids mean.

The same ids name different layers depending on who wrote them. Each trainer's
exporter was read in its own source and run (``tests/data/trainer_configs/``,
made with each exporter's own code; ``docs/engine_facts.md`` section 7). Layers
are named here as capture layers: capture layer c = the input of layer c = the
output of layer c - 1 (HF ``hidden_states[c]``); both engines number their
captures so.

* SpecForge (``LlamaForCausalLMEagle3``, ``eagle_config`` = ids +
  ``use_aux_hidden_state``): its training data came from its Hugging Face target
  (the output of layer X, ``hidden_states[X + 1]``) or from the SGLang it pinned
  (:data:`SPECFORGE_SGLANG_PINS`), through the target model's own
  ``set_eagle3_layers_to_capture`` of that release. One reading per distinct
  answer: they differ where a pinned rule does not add 1 (DeepseekV2 with
  ``ids[0] != 1`` from 0.5.13, gpt_oss's final boundary from 0.5.18): ambiguous.
  A template with no ids and no marker is "SpecForge or TorchSpec".
* speculators (``speculators_model_type`` / ``speculators_config``): top-level ids
  handed to vLLM unchanged: the input convention (``null``: unknown).
* NVIDIA Model Optimizer (``eagle_config`` with ``next_layer_regular`` /
  ``parallel_draft_step``): the output convention for data from its HF dump; its
  vLLM dump passed the ids to vLLM unshifted in part of its history, and the
  data records no ids: always ambiguous.
* TorchSpec (``_torchspec_version``): the output convention; its ``--vllm``
  conversion adds 1 to the ids for ``model_type: kimi_k2`` and leaves no marker:
  for Kimi, ids equal to the input-convention default ``[2, n//2, n-3]`` (what
  ``--vllm`` makes of the default) are ambiguous, the output-convention default
  is the native export, anything else ambiguous.
* AngelSlim (``Eagle3LlamaForCausalLM`` / top-level ``aux_hidden_states_layer_ids``):
  the output convention, in a key no engine reads (the engines capture their
  defaults).
* DeepSpec (a top-level ``target_layer_ids``): the output convention (it hooks
  each named layer's output); vLLM's V2 runner reads them with 1 added.
* SafeAILab EAGLE (a plain one-layer ``LlamaForCausalLM`` with ``draft_vocab_size``):
  no ids; layers ``[2, n//2, n-3]`` hard-coded as capture layers.

A draft that writes no ids is read as trained on its trainer's default where the
trainer is recognised and has one (:data:`NO_ID_DEFAULTS`: the engines' own
default layers); a speculators draft whose ids are SpecForge's default list is
read both ways (a converted draft keeps SpecForge's ids verbatim).

An unrecognised config is read in the output convention, said as assumed;
ids equal to the input-convention default then are ambiguous.
"""

import functools
import json
import os
import re
from dataclasses import dataclass, field, replace
from typing import Optional

from eagle_capture.layer_ids.lines import CapturePlanError
from eagle_capture.layer_ids.rules import SHIFT_ALWAYS, apply_rule, sglang_model_rule

__all__ = ["Provenance", "Reading", "defaults_accepted", "recognise", "CONVENTIONS"]

CONVENTIONS = ("auto", "output", "input")
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
ANGELSLIM_KEY = "aux_hidden_states_layer_ids"
MODELOPT_KEYS = ("next_layer_regular", "parallel_draft_step", "parallel_draft_heads_num_layers")
SPECULATORS_KEYS = ("speculators_model_type", "speculators_config", "speculators_version")
# What `eagle-capture doctor --write-config` records beside the ids it writes: the capture
# layers the draft was trained on, as decided when the fix was written. Read back, the
# rewritten ids need no convention (they are one engine line's ids, no trainer's), so a
# fixed config checked again is read the same way. Engines ignore the key.
RECORD_KEY = "eagle_capture"
RECORD_LAYERS = "trained_capture_layers"

# SpecForge's history as data: from which commit its training data came from which
# capture (read in SpecForge's requirements.txt / pyproject.toml at each commit, and
# scripts/prepare_hidden_states.py / specforge/core/eagle3.py of v0.1.0). Before the
# first pin its Hugging Face target took hidden_states[X + 1] (the output
# convention); each SGLang pin captured the ids through the target model's own
# set_eagle3_layers_to_capture of that release. (date, commit, SGLang pin)
SPECFORGE_SGLANG_PINS = (
    ("2025-09-01", "94d67101", "0.5.1"),
    ("2025-11-08", "cd975162", "0.5.4"),
    ("2025-11-23", "00edc174", "0.5.5"),
    ("2025-12-25", "ee22b877", "0.5.6"),
    ("2026-03-16", "961ca7c3", "0.5.9"),
    ("2026-06-26", "9a1c9803", "0.5.14"),
)

# What each trainer trains on when the draft config names no ids: the output-
# convention list [1, n//2 - 1, n - 4], i.e. capture layers [2, n//2, n - 3] -- the
# engines' own default. Read in: SpecForge resolve_eagle_capture_layers
# (specforge/algorithms/model_providers.py, a6b6b02; v0.1.0's
# prepare_hidden_states.py the same list); TorchSpec get_default_eagle3_aux_layer_ids
# (torchspec/utils/misc.py, 6f21829; its SGLang engine passes them to SGLang, its vLLM
# engine adds 1); AngelSlim (hidden_states[id + 1] of the same list).
NO_ID_DEFAULTS = {
    "SpecForge": "SpecForge's resolve_eagle_capture_layers",
    "TorchSpec": "TorchSpec's get_default_eagle3_aux_layer_ids",
    "SpecForge or TorchSpec": "SpecForge's and TorchSpec's default",
    "AngelSlim": "AngelSlim's default",
}


def in_default(num_layers: int) -> list[int]:
    return [2, num_layers // 2, num_layers - 3]


def out_default(num_layers: int) -> list[int]:
    return [1, num_layers // 2 - 1, num_layers - 4]


def speculators_research_layers(num_layers: int) -> list[int]:
    """The capture layers speculators trained on before it wrote ids: its 2025 research
    pipeline (research/eagle3/ge_data/*sharegpt.py at v0.2.0: transformers'
    hidden_states[3], [num_layers // 2 + 1] and [-3], the last being the input of layer
    num_layers - 2; removed 2025-11), and its own trainer from 0.3.0 to 0.4.0.1
    (data_generation/custom_worker.py: the output of each of layers [2, n // 2, n - 3],
    hidden_states + residual after the layer ran; scripts/train.py wrote no ids)."""
    return [3, num_layers // 2 + 1, num_layers - 2]


# Trainer templates copied verbatim into every checkpoint they trained (the data file
# says where each was read): a draft config equal to one is that trainer's.
TEMPLATES = os.path.join(os.path.dirname(__file__), "data", "trainer_templates.json")


@functools.lru_cache(maxsize=None)
def _templates() -> dict:
    with open(TEMPLATES, encoding="utf-8") as f:
        return json.load(f)


def _template_of(config: dict) -> Optional[tuple[str, dict]]:
    """(trainer, template) when ``config`` is one of the trainer templates as shipped
    (the doctor's own record aside), else None."""
    bare = {k: v for k, v in config.items() if k != RECORD_KEY}
    for trainer, entry in _templates().items():
        for template in entry["templates"]:
            if template["config"] == bare:
                return trainer, template
    return None


RESEARCH_NOTE = "The same config"


def _research_note(num_layers: int, shape: str) -> str:
    return (
        f"{RESEARCH_NOTE} ({shape}) also came out of speculators' 2025 research pipeline "
        f"(research/eagle3, "
        f"removed 2025-11; RedHatAI's early drafts), which trained on transformers' "
        f"hidden_states[3], [L // 2 + 1], [-3] = capture layers "
        f"{speculators_research_layers(num_layers)}, one layer past "
        f"{in_default(num_layers)}: if it trained this draft, the engines' defaults feed it "
        f"one layer early. Measure it with `eagle-capture probe`"
    )


def specforge_window_layers(num_layers: int) -> list[int]:
    """The capture layers SpecForge's online trainer took for a draft config without ids
    from 94d67101 (2025-09-01) to bdbea66b (2025-10-20): specforge/core/eagle3.py's
    default [1, num_layers // 2, num_layers - 4] as hidden_states[id + 1], the middle
    one a layer past the engines' default (its offline and SGLang paths took theirs)."""
    return [2, num_layers // 2 + 1, num_layers - 3]


SPECFORGE_WINDOW_NOTE = "SpecForge's online trainer"


def _specforge_window_note(num_layers: int) -> str:
    return (
        f"{SPECFORGE_WINDOW_NOTE} (its Hugging Face target) took "
        f"[1, L // 2, L - 4] for a config without ids from 2025-09-01 to 2025-10-20 "
        f"(specforge/core/eagle3.py, 94d67101 - bdbea66b): capture layers "
        f"{specforge_window_layers(num_layers)}, the middle one a layer past "
        f"{in_default(num_layers)}. A draft trained online in those weeks gets its middle "
        f"slot one layer early from the engines' defaults: measure it with `eagle-capture probe`"
    )


@dataclass(frozen=True)
class Reading:
    """One way to read the draft's ids: the capture layers it was trained on."""

    label: str  # "output convention", "input convention", ...
    expected: Optional[tuple[int, ...]]  # capture layers, ascending; None: unknown (no ids)
    why: str = ""

    @property
    def convention(self) -> str:
        return "input" if self.label.startswith("input") else "output"


@dataclass(frozen=True)
class Provenance:
    trainer: str  # "" when not recognised
    evidence: str  # the keys it was recognised from
    ids: Optional[list[int]]  # the ids the trainer wrote (None: none)
    field: str  # where they are
    readings: tuple[Reading, ...]  # one: decided; more: ambiguous
    notes: tuple[str, ...] = field(default_factory=tuple)
    # "markers" | "--id-convention" | "--accept-defaults" | "assumed" | "layer count"
    # (the other reading names layers the target does not have)
    decided_by: str = "markers"
    # Another trainer whose configs look the same, in a few words for the short answer
    # (its note says the rest)
    caveat: str = ""

    @property
    def ambiguous(self) -> bool:
        return len({r.expected for r in self.readings}) > 1

    @property
    def names_embedding(self) -> bool:
        """Its ids name the embedding output: a negative id, read in the output convention."""
        return (
            bool(self.ids)
            and min(self.ids) < 0
            and any(r.convention == "output" and r.expected for r in self.readings)
        )

    def describe(self) -> str:
        who = (
            f"{self.trainer} (recognised from {self.evidence})"
            if self.trainer
            else "not recognised from the config's keys"
        )
        ids = f"{self.field} = {self.ids}" if self.ids is not None else "no ids written"
        if self.ambiguous:
            how = (
                "AMBIGUOUS: "
                + "; or ".join(
                    f"{r.label}: trained on capture layers {list(r.expected)}"
                    + (f" ({r.why})" if r.why else "")
                    for r in self.readings
                )
                + (
                    ". The probe decides (--accept-defaults: the defaults); until then no "
                    "single fix is given"
                    if self.ids is None
                    else ". --id-convention output|input decides; until then no single fix is given"
                )
            )
        else:
            r = self.readings[0]
            layers = (
                ""
                if r.expected is None
                else f"capture layers {list(r.expected)} (outputs of layers "
                f"{[c - 1 for c in r.expected]})"
            )
            by = {
                "--id-convention": " (as --id-convention says)",
                "--accept-defaults": " (as --accept-defaults says)",
                "assumed": " (ASSUMED)",
                "layer count": " (the only reading that names existing layers)",
            }.get(self.decided_by, "")
            how = (
                f"read as {r.label}{by}: the layers it was trained on are unknown (no ids)"
                if r.expected is None
                else f"read as {r.label}{by}: trained on {layers}"
            ) + (f"; {r.why}" if r.why else "")
        return f"trainer: {who}; {ids}; {how}"

    def brief(self) -> str:
        """Who trained the draft and on which capture layers, in one sentence."""
        who = self.trainer or "trainer not recognised"
        ids = f"{self.field} = {self.ids}" if self.ids is not None else "no ids written"
        layers = [
            f"{list(r.expected)} ({r.label.split(' (')[0]})"
            for r in self.readings
            if r.expected is not None
        ]
        if not layers:
            trained = "the layers it was trained on are unknown"
        elif self.ambiguous:
            trained = "trained on capture layers " + " or ".join(layers) + ": AMBIGUOUS"
        else:
            by = {
                "--id-convention": ", as --id-convention says",
                "--accept-defaults": ", as --accept-defaults says",
                "assumed": ", ASSUMED",
                "layer count": ", the only reading that names existing layers",
            }.get(self.decided_by, "")
            trained = f"trained on capture layers {layers[0][:-1]}{by})"
        caveat = f"; {self.caveat}" if self.caveat else ""
        return f"trainer: {who}; {ids}; {trained}{caveat}"


def _shifted(ids, by: int) -> Optional[tuple[int, ...]]:
    return None if ids is None else tuple(sorted(i + by for i in ids))


def _out(ids, why="") -> Reading:
    return Reading("output convention (id X = the output of layer X)", _shifted(ids, 1), why)


def _in(ids, why="") -> Reading:
    return Reading("input convention (id X = the input of layer X)", _shifted(ids, 0), why)


def _markers(config: dict) -> tuple[str, str]:
    """(trainer, evidence) from the exported config's own keys."""
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else None
    archs = config.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""
    found = [k for k in SPECULATORS_KEYS if k in config]
    if found or arch == "Eagle3Speculator":
        return "speculators", ", ".join(found or ["architectures Eagle3Speculator"])
    if "_torchspec_version" in config:
        return "TorchSpec", "_torchspec_version"
    if (
        isinstance(config.get("target_layer_ids"), list)
        and IDS_KEY not in config
        and not (eagle and IDS_KEY in eagle)
    ):
        return "DeepSpec", "top-level target_layer_ids" + (
            f", architectures {arch}" if arch else ""
        )
    if eagle is not None and any(k in eagle for k in MODELOPT_KEYS):
        return (
            "NVIDIA Model Optimizer",
            "eagle_config keys " + ", ".join(k for k in MODELOPT_KEYS if k in eagle),
        )
    if ANGELSLIM_KEY in config or arch == "Eagle3LlamaForCausalLM" or "modal_type" in config:
        keys = [k for k in (ANGELSLIM_KEY, "modal_type") if k in config]
        return "AngelSlim", ", ".join(
            keys + ([f"architectures {arch}"] if arch == "Eagle3LlamaForCausalLM" else [])
        )
    if arch == "LlamaForCausalLMEagle3" and eagle is None and IDS_KEY not in config:
        # SpecForge's and TorchSpec's templates without ids look alike (TorchSpec's
        # exporter adds _torchspec_version); both train such a draft on the same layers.
        return (
            "SpecForge or TorchSpec",
            "architectures LlamaForCausalLMEagle3, no eagle_config, no _torchspec_version",
        )
    if arch == "LlamaForCausalLMEagle3" and (
        eagle is None or set(eagle) <= {IDS_KEY, "use_aux_hidden_state"}
    ):
        return "SpecForge", (
            "architectures LlamaForCausalLMEagle3"
            + (", eagle_config = {ids, use_aux_hidden_state}" if eagle else ", no eagle_config")
        )
    template = _template_of(config)
    if template is not None:
        trainer, found = template
        return trainer, f"its {found['file']} as shipped (commit {found['commit'][:8]})"
    if (
        arch == "LlamaForCausalLM"
        and "draft_vocab_size" in config
        and eagle is None
        and IDS_KEY not in config
        and config.get("num_hidden_layers") == 1
    ):
        return "SafeAILab EAGLE", "a one-layer LlamaForCausalLM with draft_vocab_size, no ids"
    return "", ""


# Id keys an engine reads (top level / in eagle_config); AngelSlim's own is noted apart.
_READ_KEYS = {
    IDS_KEY,
    ANGELSLIM_KEY,
    "num_aux_hidden_states",
    "target_layer_ids",
    "dspark_target_layer_ids",
}
_READ_NESTED = {IDS_KEY, "layer_ids"}


def _ignored_keys(config: dict) -> list[str]:
    """Keys that look like layer ids but that no engine reads (a misspelling)."""

    def looks(key: str) -> bool:
        return (
            re.search(r"layers?_ids?\b|layers?_to_capture|capture_layers", key.lower()) is not None
        )

    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    found = [k for k in config if looks(k) and k not in _READ_KEYS] + [
        f"eagle_config.{k}" for k in eagle if looks(k) and k not in _READ_NESTED
    ]

    def value(key: str):
        return (eagle if key.startswith("eagle_config.") else config).get(key.split(".")[-1])

    return [
        f"{key} = {value(key)!r} is read by no engine (SGLang reads eagle_config.{IDS_KEY}, vLLM the top-level "
        f"{IDS_KEY}): a misspelling? What the engines capture instead is below"
        for key in found
    ]


def recognise(
    draft, num_layers: int, architecture: str = "", convention: str = "auto"
) -> Provenance:
    """The trainer behind ``draft`` (a :class:`~eagle_capture.layer_ids.lines.DraftIds`)
    and the capture layers its ids were trained on, for a target of ``num_layers``
    layers and ``architecture``; ``convention`` "output" / "input" overrides the
    markers (the user knows), "auto" reads them."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    config = draft.raw or {}
    trainer, evidence = _markers(config)
    notes: list[str] = []
    # Where each trainer writes its ids.
    if trainer == "speculators":
        ids, where = draft.top_level, f"top-level {IDS_KEY}"
    elif trainer == "AngelSlim" and isinstance(config.get(ANGELSLIM_KEY), list):
        ids, where = list(config[ANGELSLIM_KEY]), f"top-level {ANGELSLIM_KEY}"
        notes.append(
            f"{ANGELSLIM_KEY} is read by no engine (SGLang reads "
            f"eagle_config.{IDS_KEY}, vLLM the top-level {IDS_KEY}): both capture "
            f"their defaults instead. Write the ids below where each engine reads"
        )
    elif trainer == "DeepSpec":
        ids, where = draft.target_layer_ids, "top-level target_layer_ids"
    elif draft.nested is not None:
        ids, where = draft.nested, f"eagle_config.{IDS_KEY}"
    else:
        ids, where = draft.top_level, f"top-level {IDS_KEY}"
    if ids is not None and any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        ids = None
    notes += _ignored_keys(config)

    if convention != "auto":
        reading = _out(ids) if convention == "output" else _in(ids)
        auto = recognise(draft, num_layers, architecture, "auto") if trainer else None
        if (
            auto is not None
            and not auto.ambiguous
            and ids is not None
            and auto.readings[0].expected != reading.expected
        ):
            notes.append(
                f"--id-convention {convention} overrides what {trainer}'s ids mean "
                f"({auto.readings[0].label}: capture layers "
                f"{list(auto.readings[0].expected)})"
            )
        return Provenance(
            trainer, evidence, ids, where, (reading,), tuple(notes), "--id-convention"
        )

    recorded = recorded_capture_layers(config, draft.source)
    if recorded is not None:
        record = config[RECORD_KEY]
        why = (
            "recorded when eagle-capture doctor --write-config wrote the ids"
            + (
                f" for {record['ids_written_for']}"
                if isinstance(record.get("ids_written_for"), str)
                else ""
            )
            + (f", from the {record['read_as']}" if isinstance(record.get("read_as"), str) else "")
        )
        evidence = ", ".join(filter(None, [evidence, f"{RECORD_KEY}.{RECORD_LAYERS}"]))
        return Provenance(
            trainer,
            evidence,
            ids,
            where,
            (
                Reading(
                    "input convention (the recorded capture layers)", tuple(sorted(recorded)), why
                ),
            ),
            tuple(notes),
        )

    if trainer == "speculators":
        readings = (
            _in(
                ids,
                "speculators hands its ids to vLLM unchanged; its converter copies "
                "the ids given verbatim, so a SpecForge list converted as is would "
                "be one layer early",
            ),
        )
        if ids is not None and sorted(ids) == out_default(num_layers):
            # The output-convention default of SpecForge / TorchSpec: the mark of a
            # draft converted with its ids copied as they were.
            readings = (
                _out(
                    ids,
                    "a SpecForge or TorchSpec draft converted by speculators' "
                    f"converter, which copies the ids verbatim: {ids} is "
                    f"SpecForge's default list for {num_layers} layers",
                ),
                _in(ids, "trained by speculators on vLLM's own captures"),
            )
            notes.append(
                f"{ids} is SpecForge's and TorchSpec's default list (output "
                f"convention) for a {num_layers}-layer target: the mark of a draft "
                f"converted to speculators' format with its ids copied verbatim. "
                f"Only the draft's training run can say which reading is right: "
                f"measure it with `eagle-capture probe`"
            )
        if ids is None:
            # Two histories write no ids, one layer apart (speculators_research_layers):
            # only the probe tells them apart.
            readings = (
                Reading(
                    "speculators' own training (before it wrote ids)",
                    tuple(speculators_research_layers(num_layers)),
                    "speculators 0.3.0 - 0.4.0.1 trained on each named layer's output "
                    f"(layers {[c - 1 for c in speculators_research_layers(num_layers)]}: "
                    "data_generation/custom_worker.py) and wrote no ids (scripts/train.py); "
                    "its 2025 research pipeline (RedHatAI's early drafts) took the same layers",
                ),
                Reading(
                    "a draft converted without ids (trained on the defaults)",
                    tuple(in_default(num_layers)),
                    "speculators' converter writes no ids unless given them "
                    "(convert/eagle/eagle3_converter.py): a SafeAILab EAGLE-3 or an id-less "
                    "SpecForge draft converted so was trained on the engines' defaults",
                ),
            )
            notes.append(
                "speculators wrote no ids: a draft from its own trainer before 0.5.0 (or its "
                "2025 research pipeline) was trained one layer past the engines' defaults, "
                "a draft converted from SafeAILab's or SpecForge's defaults on them. Only the "
                "draft's training run can say which: measure it with `eagle-capture probe`, "
                "or pass --accept-defaults if it was trained on the defaults"
            )
    elif trainer in NO_ID_DEFAULTS and ids is None:
        readings = (
            Reading(
                "trainer's default (no ids written)",
                tuple(in_default(num_layers)),
                f"{NO_ID_DEFAULTS[trainer]} takes the outputs of layers "
                f"{out_default(num_layers)}, the layers both engines capture by "
                f"default",
            ),
        )
        where = f"none written; {NO_ID_DEFAULTS[trainer]} {out_default(num_layers)}"
        if "SpecForge" in trainer:
            notes.append(_specforge_window_note(num_layers))
    elif trainer == "SpecForge":
        readings = _specforge_readings(ids, num_layers, architecture)
    elif trainer == "NVIDIA Model Optimizer":
        readings = (
            _out(ids, "data from its Hugging Face dump"),
            _in(ids, "data from its vLLM dump with the ids passed unshifted"),
        )
    elif trainer == "TorchSpec":
        kimi = config.get("model_type") == "kimi_k2"
        if not kimi or ids is None or sorted(ids) == out_default(num_layers):
            readings = (
                _out(
                    ids,
                    "TorchSpec's native export"
                    + (
                        f"; its --vllm conversion would have written {in_default(num_layers)}"
                        if kimi and ids is not None
                        else ""
                    ),
                ),
            )
        else:
            readings = (
                _in(ids, "after TorchSpec's --vllm conversion (+1 for kimi_k2)"),
                _out(ids, "TorchSpec's native export"),
            )
    elif trainer == "AngelSlim":
        readings = (
            _out(
                ids if ids is not None else out_default(num_layers),
                "AngelSlim takes hidden_states[X + 1]"
                + ("; no ids written: its default" if ids is None else ""),
            ),
        )
        if ids is None:
            ids, where = out_default(num_layers), "AngelSlim's default (none written)"
    elif trainer == "DeepSpec":
        readings = (
            _out(
                ids,
                "DeepSpec hooks each named target layer's output "
                "(run_target_forward_with_hooks: hidden_states[X + 1])",
            ),
        )
        notes.append(
            "SGLang's EAGLE-3 target reads no target_layer_ids (only eagle_config's "
            f"{IDS_KEY}); vLLM's V2 runner reads them, adding 1"
        )
    elif trainer == "speculators research pipeline":
        readings = (
            Reading(
                "the research pipeline's layers (hidden_states[3], [L // 2 + 1], [-3])",
                tuple(speculators_research_layers(num_layers)),
                "its train/*.json is copied into every checkpoint it trained "
                "(research/eagle3/convert.sh), its data took those states "
                "(ge_data/*sharegpt.py)",
            ),
        )
    elif trainer == "SafeAILab EAGLE":
        readings = (_in(in_default(num_layers), "hard-coded in SafeAILab's EAGLE-3 training"),)
        notes.append(_research_note(num_layers, "SafeAILab's shape"))
    else:
        if ids is not None and sorted(ids) == in_default(num_layers):
            readings = (_out(ids), _in(ids, "the input-convention default"))
        elif ids and min(ids) >= 0 and max(ids) == num_layers:
            # id num_layers names the last layer's output only as an input-convention
            # id (the final boundary); as an output one it names a layer that is not there.
            readings = (_out(ids), _in(ids))
        else:
            readings = (_out(ids),)
        readings, dropped = _existing(readings, num_layers)
        return Provenance(
            "",
            "",
            ids,
            where,
            readings,
            tuple(notes + dropped),
            "markers" if len(readings) > 1 else "layer count" if dropped else "assumed",
        )
    readings, dropped = _existing(readings, num_layers)
    caveat = (
        f"or {speculators_research_layers(num_layers)} if speculators' 2025 research "
        f"pipeline trained it (note below: --explain)"
        if any(n.startswith(RESEARCH_NOTE) for n in notes)
        else f"or {specforge_window_layers(num_layers)} if SpecForge's online trainer of "
        f"2025-09-01 - 2025-10-20 trained it (note below: --explain)"
        if any(n.startswith(SPECFORGE_WINDOW_NOTE) for n in notes)
        else ""
    )
    return Provenance(
        trainer, evidence, ids, where, readings, tuple(notes + dropped), caveat=caveat
    )


def defaults_accepted(provenance: Provenance, num_layers: int) -> Provenance:
    """``provenance`` under --accept-defaults: a draft with no ids read more than one way
    (a speculators draft) is read as trained on the engines' defaults, where that is one
    of its readings."""
    if provenance.ids is not None or not provenance.ambiguous:
        return provenance
    kept = tuple(r for r in provenance.readings if r.expected == tuple(in_default(num_layers)))
    if not kept:
        return provenance
    return replace(provenance, readings=kept, decided_by="--accept-defaults")


def _existing(readings, num_layers: int) -> tuple[tuple[Reading, ...], list[str]]:
    """The readings whose capture layers all exist in a target of ``num_layers`` layers
    (capture layer c = the input of layer c; c = num_layers: the last layer's output),
    and a note for each one dropped; all of them where none is left (the ids are then
    wrong whichever way they are read, which the verdict says)."""
    kept = tuple(
        r for r in readings if r.expected is None or all(0 <= c <= num_layers for c in r.expected)
    )
    if not kept or len(kept) == len(readings):
        return tuple(readings), []
    notes = [
        f"not read as the {r.label.split(' (')[0]}: it would name capture layer(s) "
        f"{[c for c in r.expected if not 0 <= c <= num_layers]}, outside the embedding "
        f"(0) to the output of the last of {num_layers} layers"
        for r in readings
        if r not in kept
    ]
    return kept, notes


def recorded_capture_layers(config: dict, source: str = "the draft config") -> Optional[list[int]]:
    """The capture layers ``--write-config`` recorded in ``config`` (None: no record).
    A record that is not a list of distinct non-negative integers is refused
    (CapturePlanError): it was edited, and reading past it would guess."""
    record = config.get(RECORD_KEY)
    if record is None:
        return None
    layers = record.get(RECORD_LAYERS) if isinstance(record, dict) else None
    if (
        not isinstance(layers, list)
        or not layers
        or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in layers)
        or len(set(layers)) != len(layers)
    ):
        raise CapturePlanError(
            f"{source}: {RECORD_KEY}.{RECORD_LAYERS} must be a list of distinct non-negative "
            f"integers (the capture layers eagle-capture recorded), got "
            f"{layers if isinstance(record, dict) else record!r}"
        )
    return list(layers)


def _specforge_readings(ids, num_layers: int, architecture: str) -> tuple[Reading, ...]:
    """The capture layers a SpecForge draft's ids were trained on, one reading per
    distinct answer over SpecForge's history: its Hugging Face target backend
    (hidden_states[X + 1]) and each pinned SGLang's rule for the target model
    (pins older than every wheel read take the oldest read, 0.5.9, whose rules the
    older releases share)."""
    # The doctor assumes DeepseekV2's rule when the architecture is not given.
    arch = architecture or "DeepseekV3ForCausalLM"
    found: dict[tuple[int, ...], list] = {_shifted(ids, 1): ["HF"]}
    for date, _commit, pin in SPECFORGE_SGLANG_PINS:
        version = tuple(int(p) for p in pin.split("."))
        rule = sglang_model_rule(max(version, (0, 5, 9)), arch)
        captured = apply_rule(rule.rule if rule else SHIFT_ALWAYS, ids, num_layers)
        found.setdefault(tuple(sorted(captured)), []).append((date, pin))
    if len(found) == 1:
        return (
            _out(
                ids,
                "what SpecForge captured on every SGLang it pinned, as its HF "
                "backend's hidden_states[X + 1]",
            ),
        )
    readings = []
    for expected, sources in found.items():
        label = (
            "output convention (id X = the output of layer X)"
            if expected == _shifted(ids, 1)
            else "input convention (id X = the input of layer X)"
            if expected == _shifted(ids, 0)
            else "SpecForge's capture of them"
        )
        pins = [p for p in sources if p != "HF"]
        said = (["its Hugging Face target (hidden_states[X + 1])"] if "HF" in sources else []) + (
            [
                f"SGLang {pins[0][1]}"
                + (f" - {pins[-1][1]}" if len(pins) > 1 else "")
                + f" as pinned from {pins[0][0]}"
            ]
            if pins
            else []
        )
        readings.append(
            Reading(
                label,
                expected,
                f"SpecForge's data from {' and '.join(said)}, with "
                f"{architecture or 'DeepseekV2 (assumed)'}'s rule",
            )
        )
    return tuple(readings)
