"""Per-model EAGLE-3 id rules: what each SGLang model class's own
``set_eagle3_layers_to_capture`` does with a draft's ids.

SGLang has no single id rule. Each model class turns the draft config's ids
into its ``layers_to_capture`` (capture layer i = the input of layer i, taken at
the start of layer i; i = num_layers: the final boundary, where the loop has one)
in its own way. Three rules are in the wheels read (0.5.9 - 0.5.23):

* ``+1`` -- every id + 1 (llama, qwen2/3, qwen3_moe, glm4_moe, minimax_m2, gemma3, ...;
  DeepseekV2 itself up to 0.5.12);
* ``+1 if ids[0] == 1`` -- DeepseekV2 from 0.5.13 and glm4_moe_lite: ids are read
  in the output convention only when they start at layer 1 (SpecForge's default),
  else taken as capture layers (the input convention);
* ``kept at the final boundary`` -- gpt_oss (0.5.17+): ids whose largest is
  num_layers are taken as capture layers (the loop captures the final boundary
  after the last layer), others + 1.

Without ids every class read captures ``[2, n // 2, n - 3]``.

The doctor reads each class's rule from the engine facts generated from the
wheels' source (:mod:`.engine_facts`, which follows subclasses and delegation to
an inner language model). The table below is the witness: each row was taken by
calling the class's own method from the real wheel, CI does so again
(``tests/test_sglang_real.py``, scenario ``model_id_rules``), and the generated
facts must agree with every row (``tests/test_engine_facts.py``). An architecture
without a rule gets none silently: :func:`sglang_model_rule` returns None and the
doctor says why (cannot capture there) or what it assumes.
"""

from dataclasses import dataclass
from typing import Optional, Sequence

from eagle_capture.layer_ids.id_rules import (
    KEEP_FINAL_BOUNDARY,
    RULE_WORDS,
    SHIFT_ALWAYS,
    SHIFT_IF_FIRST_IS_1,
    apply_rule,
)


@dataclass(frozen=True)
class ModelRule:
    """One architecture's id rule in one SGLang wheel."""

    architecture: str
    rule: str
    source: str  # "models/<file>.py <Class>.set_eagle3_layers_to_capture"
    read_version: str  # the wheel it was read from and run against
    boundary: bool = False  # its loop captures after the last layer (the engine facts)

    @property
    def final_boundary(self) -> bool:
        """Whether capture layer num_layers (the last layer's output) is captured."""
        return self.rule == KEEP_FINAL_BOUNDARY or self.boundary

    @property
    def deepseek_loop(self) -> bool:
        """DeepseekV2's own loop (the one whose layer-0 and missing-capture
        behaviour per line the doctor knows from running it)."""
        return self.source.startswith("models/deepseek_v2.py")

    def capture_layers(self, ids: Optional[Sequence[int]], num_layers: int) -> list[int]:
        return apply_rule(self.rule, ids, num_layers)

    def describe(self) -> str:
        return (
            f"{self.architecture}: {self.source} {RULE_WORDS[self.rule]} "
            f"(read in SGLang {self.read_version})"
        )


# Per wheel read: architecture (a model file's EntryClass) -> (rule, the
# "file.Class" whose set_eagle3_layers_to_capture it runs). Taken by calling
# each class's own method on a shell (the CI scenario model_id_rules does the
# same and compares on the wheels it runs; 0.5.14 and 0.5.17, the first release of
# their lines, were run the same way once); a class whose method needs more than a
# shell is left out. The doctor reads the generated engine facts, which hold every
# class; these rows are checked against them on every column. Each column after the
# first is written as what changed from the one before.
def _then(before: dict, changed: dict, gone: tuple = ()) -> dict:
    """A column: the one before with ``changed`` rows added or replaced, ``gone`` left out."""
    return {arch: row for arch, row in {**before, **changed}.items() if arch not in gone}


_RULES_0_5_9 = {
    "ApertusForCausalLM": (SHIFT_ALWAYS, "apertus.ApertusForCausalLM"),
    "BailingMoEForCausalLM": (SHIFT_ALWAYS, "bailing_moe.BailingMoEForCausalLM"),
    "BailingMoeForCausalLM": (SHIFT_ALWAYS, "bailing_moe.BailingMoEForCausalLM"),
    "BailingMoeV2ForCausalLM": (SHIFT_ALWAYS, "bailing_moe.BailingMoEForCausalLM"),
    "DeepseekV2ForCausalLM": (SHIFT_ALWAYS, "deepseek_v2.DeepseekV2ForCausalLM"),
    "DeepseekV32ForCausalLM": (SHIFT_ALWAYS, "deepseek_v2.DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": (SHIFT_ALWAYS, "deepseek_v2.DeepseekV2ForCausalLM"),
    "ExaoneMoEForCausalLM": (SHIFT_ALWAYS, "exaone_moe.ExaoneMoEForCausalLM"),
    "Glm4MoeForCausalLM": (SHIFT_ALWAYS, "glm4_moe.Glm4MoeForCausalLM"),
    "GlmMoeDsaForCausalLM": (SHIFT_ALWAYS, "deepseek_v2.DeepseekV2ForCausalLM"),
    "GptOssForCausalLM": (SHIFT_ALWAYS, "gpt_oss.GptOssForCausalLM"),
    "IQuestCoderForCausalLM": (SHIFT_ALWAYS, "llama.LlamaForCausalLM"),
    "InternLM3ForCausalLM": (SHIFT_ALWAYS, "llama.LlamaForCausalLM"),
    "LlamaForCausalLM": (SHIFT_ALWAYS, "llama.LlamaForCausalLM"),
    "LongcatFlashForCausalLM": (SHIFT_ALWAYS, "longcat_flash.LongcatFlashForCausalLM"),
    "MiniMaxM2ForCausalLM": (SHIFT_ALWAYS, "minimax_m2.MiniMaxM2ForCausalLM"),
    "Phi3ForCausalLM": (SHIFT_ALWAYS, "llama.LlamaForCausalLM"),
    "Qwen2ForCausalLM": (SHIFT_ALWAYS, "qwen2.Qwen2ForCausalLM"),
    "Qwen2MoeForCausalLM": (SHIFT_ALWAYS, "qwen2_moe.Qwen2MoeForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": (
        SHIFT_ALWAYS,
        "qwen2_5_vl.Qwen2_5_VLForConditionalGeneration",
    ),
    "Qwen3ForCausalLM": (SHIFT_ALWAYS, "qwen3.Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": (SHIFT_ALWAYS, "qwen3_moe.Qwen3MoeForCausalLM"),
    "Qwen3NextForCausalLM": (SHIFT_ALWAYS, "qwen3_next.Qwen3NextForCausalLM"),
}
_RULES_0_5_13 = _then(
    _RULES_0_5_9,
    {
        # DeepseekV2's method reads ids[0] == 1 from 0.5.13.
        "DeepseekV2ForCausalLM": (SHIFT_IF_FIRST_IS_1, "deepseek_v2.DeepseekV2ForCausalLM"),
        "DeepseekV32ForCausalLM": (SHIFT_IF_FIRST_IS_1, "deepseek_v2.DeepseekV2ForCausalLM"),
        "DeepseekV3ForCausalLM": (SHIFT_IF_FIRST_IS_1, "deepseek_v2.DeepseekV2ForCausalLM"),
        "GlmMoeDsaForCausalLM": (SHIFT_IF_FIRST_IS_1, "deepseek_v2.DeepseekV2ForCausalLM"),
        "Gemma3ForCausalLM": (SHIFT_ALWAYS, "gemma3_causal.Gemma3ForCausalLM"),
        "Gemma4ForCausalLM": (SHIFT_ALWAYS, "gemma4_causal.Gemma4ForCausalLM"),
        "Glm4MoeLiteForCausalLM": (SHIFT_IF_FIRST_IS_1, "glm4_moe_lite.Glm4MoeLiteForCausalLM"),
        "Qwen3VLForConditionalGeneration": (
            SHIFT_ALWAYS,
            "qwen3_vl.Qwen3VLForConditionalGeneration",
        ),
    },
)
_RULES_0_5_17 = _then(
    _RULES_0_5_13,  # 0.5.14: the same rows
    {
        "GptOssForCausalLM": (KEEP_FINAL_BOUNDARY, "gpt_oss.GptOssForCausalLM"),
        "EmbeddingGemmaModel": (SHIFT_ALWAYS, "gemma3_causal.Gemma3ForCausalLM"),
        "GlmMoeDsaForCausalLMNextN": (SHIFT_IF_FIRST_IS_1, "deepseek_v2.DeepseekV2ForCausalLM"),
        # Its method sets ids its model never reads (0.5.17: the loop reads its own flags).
        "MiniMaxM3SparseForCausalLM": (SHIFT_ALWAYS, "minimax_m3.MiniMaxM3SparseForCausalLM"),
    },
)
# 0.5.18: MiniMax-M3's method needs more than a shell.
_RULES_0_5_18 = _then(_RULES_0_5_17, {}, gone=("MiniMaxM3SparseForCausalLM",))
_RULES_0_5_20 = _then(
    _RULES_0_5_18,
    {
        "Glm5NextForConditionalGeneration": (
            SHIFT_ALWAYS,
            "glm5_next.Glm5NextForConditionalGeneration",
        )
    },
)
SGLANG_MODEL_RULES: dict[str, dict[str, tuple[str, str]]] = {
    "0.5.9": _RULES_0_5_9,
    "0.5.13": _RULES_0_5_13,
    "0.5.14": _RULES_0_5_13,
    "0.5.17": _RULES_0_5_17,
    "0.5.18": _RULES_0_5_18,
    "0.5.20": _RULES_0_5_20,
    "0.5.23": _then(
        _RULES_0_5_20,
        {
            "ExaoneMoeForCausalLM": (SHIFT_ALWAYS, "exaone_moe.ExaoneMoEForCausalLM"),
            "Qwen3_5ForConditionalGeneration": (
                SHIFT_ALWAYS,
                "qwen3_vl.Qwen3VLForConditionalGeneration",
            ),
            "Qwen3_5MoeForConditionalGeneration": (
                SHIFT_ALWAYS,
                "qwen3_vl.Qwen3VLForConditionalGeneration",
            ),
        },
    ),
}

# Wrapper architecture -> the architecture whose rule it forwards to (the wrapper has the
# method from 0.5.10, models/kimi_k25.py:841; checked by the CI scenario on each wheel run
# where it has it: 0.5.13 on).
WRAPPERS = {"KimiK25ForConditionalGeneration": "DeepseekV3ForCausalLM"}


def _read_version(version: tuple[int, ...]) -> Optional[str]:
    """The newest wheel of the table not newer than ``version``."""
    read = [v for v in SGLANG_MODEL_RULES if tuple(map(int, v.split("."))) <= version]
    return max(read, key=lambda v: tuple(map(int, v.split(".")))) if read else None


def model_rule_of(architecture: str, fact: Optional[dict], release: str) -> Optional[ModelRule]:
    """The :class:`ModelRule` of a generated fact (``engine_facts.target``), or None
    when the class cannot capture there or its rule is not one of RULE_WORDS."""
    if not fact or fact.get("capture") is not True or fact.get("rule") not in RULE_WORDS:
        return None
    file, cls = fact["owner"].rsplit(".", 1)
    inner = fact.get("via", [])[1:]
    via = f" (via {', '.join(v.rsplit('.', 1)[1] for v in inner)})" if inner else ""
    return ModelRule(
        architecture,
        fact["rule"],
        f"models/{file}.py {cls}.set_eagle3_layers_to_capture{via}",
        release,
        bool(fact.get("final_boundary")),
    )


def sglang_model_rule(version: tuple[int, ...], architecture: str) -> Optional[ModelRule]:
    """The rule of ``architecture`` in SGLang ``version`` (from the newest wheel
    read at or below it: the generated engine facts), or None: not registered
    there, its class cannot capture, or its rule could not be classified."""
    from eagle_capture.layer_ids import engine_facts

    release = engine_facts.read_release("sglang", version)
    if release is None:
        return None
    return model_rule_of(
        architecture, engine_facts.target("sglang", release, architecture), release
    )
