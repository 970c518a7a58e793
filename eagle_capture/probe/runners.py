"""Where the probe's target runs: one interface, :class:`TargetRunner`, for every runner.

:func:`~eagle_capture.probe.probe.run_probe` picks the runner of ``--engine`` (its
``RUNNERS``), asks it what it cannot run before anything is loaded (:meth:`~TargetRunner.check`),
logs its plan (:meth:`~TargetRunner.plan`), starts it (:meth:`~TargetRunner.start`), asks
it per prompt for the target's states at the capture layers and its greedy tokens
(:meth:`~TargetRunner.run`), reads what was measured (:meth:`~TargetRunner.measured`,
:meth:`~TargetRunner.notes`) and closes it. The runners, each in its module:

* transformers on one device: :class:`~eagle_capture.probe.target.TransformersTarget`;
* vLLM's engine: :class:`~eagle_capture.probe.engine.VllmTarget`;
* SGLang's engine: :class:`~eagle_capture.probe.sglang_engine.SglangTarget`.

The two engines share :class:`EngineRunner`: the rank check's report, the plan's words,
the tensor-parallel split rule.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, ClassVar, Optional, Sequence

import torch

if TYPE_CHECKING:
    from eagle_capture.layer_ids.lines import TargetModel

__all__ = [
    "DTYPES",
    "EngineError",
    "EngineRunner",
    "Setup",
    "TargetRunner",
    "size",
    "states_bytes",
    "tp_problem",
]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

Log = Callable[[str], None]


class EngineError(ValueError):
    """A runner cannot run the probe's target as asked (an engine not installed or that
    cannot serve it, a target that does not fit): the message says why."""


@dataclass
class Setup:
    """What a runner is asked to run: the target, the capture layers the readings need
    (``keep``), the user's options and the plan's first words."""

    folder: Path
    target: "TargetModel"
    keep: Sequence[int]
    device: torch.device  # the draft's (and transformers' target's)
    dtype: str  # --dtype; "auto" (engines only): the checkpoint's
    max_tokens: int
    tp: int = 1
    engine_args: Optional[dict] = None
    sglang_version: str = ""  # the SGLang line the report shows
    draft_bytes: int = 0
    plan: str = ""  # the readings and prompts, in words

    @property
    def hidden(self) -> int:
        return self.target.hidden_size or 0


class TargetRunner(ABC):
    """The target, running somewhere: per prompt, the states at the capture layers
    ``keep`` ({c: [1, T, H]}), the greedy next token at each position [1, T] and the
    tokens' embeddings [1, T, H]. Instances have ``tp`` (ranks), ``keep`` (the capture
    layers held) and ``device``."""

    engine_name: ClassVar[str]  # --engine's word
    words: ClassVar[str]  # the runner in the report's words
    answers_for: ClassVar[tuple[str, ...]]  # the engines whose lines the report shows
    # The SGLang version a started runner serves (the report's SGLang line), or None.
    version: Optional[str] = None
    tp: int
    keep: list[int]

    @classmethod
    def check(
        cls,
        text_config: dict,
        architecture: str,
        tp: int,
        sglang_version: Optional[str],
        dtype: str = "auto",
        engine_args: Optional[dict] = None,
    ) -> Optional[str]:
        """Refuses (:class:`EngineError`) what this runner cannot run, before anything is
        loaded; the SGLang version the report shows (None: the newest read)."""
        return sglang_version

    @classmethod
    @abstractmethod
    def plan(cls, setup: Setup, log: Log) -> None:
        """Logs what the run needs (memory, settings) before anything is loaded; refuses
        (:class:`EngineError`) a target that cannot fit."""

    @classmethod
    @abstractmethod
    def start(cls, setup: Setup, log: Log) -> "TargetRunner":
        """The target loaded and running (:class:`EngineError` when it cannot be)."""

    @abstractmethod
    def reset_counts(self) -> None:
        """Start the counts a report quotes (a runner serving several probe runs)."""

    @abstractmethod
    def run(self, tokens: list[int]) -> tuple[dict[int, torch.Tensor], torch.Tensor, torch.Tensor]:
        """One prompt: (states {c: [1, T, H]}, greedy tokens [1, T], embeddings [1, T, H])."""

    @abstractmethod
    def measured(self, setup: Setup) -> dict:
        """Where and how the target ran, for the report's ``measured``."""

    def notes(self, measured: dict) -> list[str]:
        """What was measured, for the report's notes, after the prompts (``measured``
        takes the counts)."""
        return []

    @abstractmethod
    def where(self) -> str:
        """Where the target ran, in words."""

    @abstractmethod
    def close(self) -> None:
        """Frees what :meth:`start` took."""


def size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 // 10 else f"{n / 2**20:.1f} MiB"


def states_bytes(keep, max_tokens: int, hidden: int, itemsize: int) -> int:
    return len(keep) * max_tokens * (hidden or 0) * itemsize


def checkpoint_itemsize(folder: Path) -> int:
    """Bytes per element of the checkpoint's dtype (its config's), 2 when unsaid."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return 2
    name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return 4 if "32" in name else 2


# The key names vLLM reads a model's KV-head count from, in its order, the attention
# heads when none is there (ModelArchConfigConvertor.get_total_num_kv_heads, vllm 0.32.0).
_KV_HEAD_KEYS = (
    "n_head_kv",
    "num_kv_heads",
    "num_key_value_heads",
    "multi_query_group_num",
    "num_attention_groups",
)


def tp_problem(text_config: dict, tp: int, engine: str = "vLLM") -> Optional[str]:
    """Why vLLM cannot split the target (its text model's config) over ``tp`` ranks, or
    None. vLLM 0.32.0's rules: the attention heads divide over the ranks
    (ModelConfig.verify_with_parallel_config, before anything loads), and the KV heads
    either divide over the ranks or the ranks over them (QKVParallelLinear; DeepSeek's
    MLA attention has no KV heads to split). SGLang's attention asserts the same
    (LlamaAttention.__init__, llama.py:139-149 in 0.5.9, :183-193 in 0.5.23); ``engine``
    names the engine in the message."""
    heads = text_config.get("num_attention_heads")
    if not isinstance(heads, int) or isinstance(heads, bool) or heads <= 0:
        return None
    if heads % tp:
        return (
            f"the target's {heads} attention heads do not divide over {tp} ranks ({engine} "
            f"requires num_attention_heads % tensor_parallel_size == 0)"
        )
    if "kv_lora_rank" in text_config:
        return None
    kv = next((text_config[k] for k in _KV_HEAD_KEYS if text_config.get(k) is not None), heads)
    if (
        isinstance(kv, int)
        and not isinstance(kv, bool)
        and kv > 0
        and (tp % kv if tp >= kv else kv % tp)
    ):
        return (
            f"the target's {kv} KV heads and {tp} ranks: {engine} needs one to divide the "
            f"other (each rank holds whole KV heads)"
        )
    return None


class EngineRunner(TargetRunner):
    """A runner in an engine's own processes at tensor parallel ``tp``: every rank's
    captures checked against rank 0's (``ranks``, ``worst_rank_difference``), the
    engine's own sampled token against the probe's greedy one
    (``engine_disagreements``), over ``prompts``."""

    # The KV cache the plan states, and where each rank keeps a prompt's states.
    holds: ClassVar[str]
    ranks: list
    worst_rank_difference: float
    engine_disagreements: int
    prompts: int

    @classmethod
    def check(
        cls,
        text_config: dict,
        architecture: str,
        tp: int,
        sglang_version: Optional[str],
        dtype: str = "auto",
        engine_args: Optional[dict] = None,
    ) -> Optional[str]:
        split = tp_problem(text_config, tp, cls.words)
        if split:
            raise EngineError(
                f"--tp {tp}: {split}: {cls.words} cannot serve the target at tensor parallel {tp}"
            )
        version = cls.check_installed(architecture, tp, sglang_version)
        problem = cls.option_problem(dtype, engine_args or {})
        if problem:
            raise EngineError(problem)
        return version

    @classmethod
    def option_problem(cls, dtype: str, engine_args: dict) -> Optional[str]:
        """Why the engine cannot run with this --dtype and these --engine-arg, or None."""
        return None

    @classmethod
    @abstractmethod
    def check_installed(
        cls, architecture: str, tp: int, sglang_version: Optional[str]
    ) -> Optional[str]:
        """The engine is installed here and can serve this target at ``tp``; the SGLang
        version the report shows."""

    @classmethod
    @abstractmethod
    def cache(cls, setup: Setup) -> str:
        """The KV cache the engine is asked for, in words."""

    @classmethod
    def from_setup(cls, setup: Setup) -> "EngineRunner":
        """The engine started for ``setup`` (a runner's own options: :meth:`options`)."""
        return cls(
            setup.folder,
            setup.target.num_layers,
            setup.hidden,
            setup.keep,
            tp=setup.tp,
            dtype=setup.dtype,
            max_tokens=setup.max_tokens,
            engine_args=setup.engine_args,
            **cls.options(setup),
        )

    @classmethod
    def options(cls, setup: Setup) -> dict:
        """Constructor options of this engine beyond the common ones."""
        return {}

    @classmethod
    def plan(cls, setup: Setup, log: Log) -> None:
        tp, hidden, keep, max_tokens = setup.tp, setup.hidden, setup.keep, setup.max_tokens
        itemsize = (
            DTYPES[setup.dtype].itemsize
            if setup.dtype in DTYPES
            else checkpoint_itemsize(setup.folder)
        )
        on_disk = sum(f.stat().st_size for f in setup.folder.glob("*.safetensors"))
        per_rank = states_bytes(keep, max_tokens, hidden, itemsize)
        host = per_rank + states_bytes(keep, max_tokens, hidden, 4)
        words = cls.words
        log(
            f"probe: {setup.plan}; the target in {words}'s engine at tensor parallel {tp}, "
            f"dtype {setup.dtype}: {size(on_disk)} of weights on disk (~{size(on_disk // tp)} "
            f"per rank, as {words} loads them) and {cls.cache(setup)} (one prompt at a time); "
            f"per prompt each rank keeps {len(keep)} states of <= {max_tokens} tokens x "
            f"{hidden} ({size(per_rank)}) {cls.holds}, with the draft's inputs "
            f"(~{size(host)}); the draft ({size(setup.draft_bytes)}) on {setup.device}"
        )

    @classmethod
    def start(cls, setup: Setup, log: Log) -> "EngineRunner":
        t0 = time.monotonic()
        runner = cls.from_setup(setup)
        log(
            f"probe: {cls.words} served the target in {time.monotonic() - t0:.0f} s "
            f"({runner.tp} rank{'s' if runner.tp > 1 else ''}, on {runner.device})"
        )
        return runner

    def measured(self, setup: Setup) -> dict:
        return {
            "engine": self.engine_name,
            "tp": self.tp,
            "dtype": setup.dtype,
            "device": self.device,
            "hidden_size": setup.hidden,
        }

    def notes(self, measured: dict) -> list[str]:
        measured.update(
            ranks_checked=len(self.ranks),
            prompts=self.prompts,
            max_rank_difference=self.worst_rank_difference,
            engine_token_differs=self.engine_disagreements,
        )
        words = self.words
        notes = [
            f"measured in {words}'s engine at tensor parallel {self.tp}: every rank's "
            f"captured states are {measured['hidden_size']} wide (the full hidden size) and "
            f"equal to rank 0's (largest relative difference "
            f"{self.worst_rank_difference:.2g}) over {self.prompts} prompts"
        ]
        if getattr(self, "other_forwards", 0):
            measured["other_forwards"] = self.other_forwards
            notes.append(
                f"{words} ran {self.other_forwards} forwards of other tokens than the "
                f"prompts' (of its own, one token each on the lines seen): not scored"
            )
        if self.engine_disagreements:
            notes.append(
                f"{words}'s own sampled token differs from the probe's greedy token at the "
                f"last position in {self.engine_disagreements} of {self.prompts} "
                f"prompts (near-ties in the logits: computed over other rows)"
            )
        return notes

    def where(self) -> str:
        return f"{self.words}'s engine at tensor parallel {self.tp}"
