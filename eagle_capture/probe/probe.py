"""Which layers was an EAGLE-3 draft trained on? Measured, not read.

    eagle-capture probe --target TARGET_DIR --draft DRAFT_DIR [--prompts FILE]
                        [--device cuda|cpu] [--dtype bf16|fp16|fp32]
    eagle-capture probe --engine vllm --tp 8 --target TARGET_DIR --draft DRAFT_DIR ...
    eagle-capture probe --engine sglang --tp 8 --target TARGET_DIR --draft DRAFT_DIR ...

A draft's first speculative step tells: fed the states it was trained on, its
top-1 token agrees with the target's next token far more often than fed states
one layer off. The probe runs the target over calibration text -- Hugging Face
transformers on one device (hooks on the decoder layers, :mod:`.target`), or
vLLM's or SGLang's engine as it serves the target, at its tensor-parallel size
(:mod:`.engine`, :mod:`.sglang_engine`) -- keeps the state at every candidate capture
layer, and runs the draft's first step (:mod:`.draft`) once per candidate reading of
the draft's ids:

* the config's reading (its trainer's convention, :mod:`~eagle_capture.layer_ids.trainers`;
  both readings when it is ambiguous);
* the ids as written in the output and in the input convention, and the whole
  list one layer lower / higher than those;
* what each engine captures for this config (SGLang -- ``--sglang-version``, the
  newest read by default -- with the target's own rule, vLLM's runners), and the
  engines' default;
* each id alone one layer off the config's reading;
* ids not in ascending order: the config's reading with its slots in the config's
  order as well (a trainer that concatenates the states in the order the ids are
  listed, as SpecForge's Hugging Face target does; the engines concatenate in
  layer order). A draft trained so is told how to reorder its ``fc`` columns.

Agreement = the share of positions t where the draft, given the target's states
at t and the token at t + 1, proposes the token the target itself predicts at
t + 1 (greedy): the first draft token's acceptance under greedy decoding.

Exit status: 0 the config's reading is what the draft was trained on and every
engine shown captures it (``--engine sglang``: SGLang's line for the installed
version; ``--engine vllm``: vLLM's; transformers: both); 1 a mismatch (the ids to write
are printed; slots in the config's order: how to reorder the draft's fc), an engine that cannot load the
draft's format, or a margin too small to tell; 2 unusable input (missing folder, unreadable draft, no
tokenizer for text prompts, a target that does not fit the device; prompt files, token ids, the
--json path and --tp are checked before anything is loaded).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence

import torch

from eagle_capture.layer_ids.deployment import wrap
from eagle_capture.layer_ids.diagnosis import (cannot_load, fix_ids, model_lines,
                                               target_cannot_capture)
from eagle_capture.layer_ids.lines import (SGLANG_LINES, VLLM_LINE, CapturePlanError, DraftIds,
                                           default_capture_layers, line_of, load_config,
                                           read_draft_ids, read_target, vllm_lines)
from eagle_capture.layer_ids.startup import slot_order_problem
from eagle_capture.layer_ids.trainers import CONVENTIONS, Provenance, recognise
from eagle_capture.probe.draft import DraftError, check_draft_class, load_draft
from eagle_capture.probe.engine import FIXED_ARGS, EngineError, check_vllm

__all__ = ["Candidate", "ProbeError", "ProbeReport", "candidates", "main", "run_probe"]

# The SGLang version whose capture the engine lines show (--sglang-version): the newest read.
SGLANG_DEFAULT = SGLANG_LINES[-1].read_versions[-1]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Where the target runs: Hugging Face transformers on one device, or an engine (whose
# lines alone the report then answers for).
ENGINES = ("transformers", "vllm", "sglang")
ENGINE_WORDS = {"vllm": "vLLM", "sglang": "SGLang"}


class ProbeError(ValueError):
    """Input the probe cannot use: the message says what and why."""


@dataclass
class Candidate:
    """One reading of the draft's ids: the capture layers it feeds the draft."""
    layers: tuple[int, ...]          # capture layers (c = the input of layer c) in the order
    #                                  the draft's fc takes them: ascending (the engines'
    #                                  order) but for a reading in the config's slot order
    labels: list[str]
    config_reading: bool = False     # one of the config's own readings
    hits: int = 0
    tokens: int = 0

    @property
    def config_order(self) -> bool:
        """Slots in the config's order, not ascending: no engine feeds that."""
        return list(self.layers) != sorted(self.layers)

    @property
    def agreement(self) -> float:
        return self.hits / self.tokens if self.tokens else 0.0

    def describe(self, num_layers: int) -> str:
        def one(c):
            return "embedding" if c == 0 else (f"out {c - 1}" if c < num_layers
                                               else f"out {c - 1} (final)")
        return f"{list(self.layers)} = {', '.join(one(c) for c in self.layers)}"


def _sglang_line(architecture: str, sglang_version: str):
    """SGLang's line for ``sglang_version`` with the target's own id rule (the
    doctor's: an architecture not read is ASSUMED to add 1, said in the notes)."""
    lines, notes = model_lines([line_of(sglang_version)], architecture, sglang_version)
    return lines[0], notes


def _engine_captures(draft: DraftIds, num_layers: int, architecture: str, sglang_version: str):
    """(short label, full label, capture layers) for what each engine captures for
    this config."""
    line, _ = _sglang_line(architecture, sglang_version)
    out = [(f"SGLang {sglang_version}", f"SGLang {sglang_version}",
            line.capture_layers(draft.read_by_target, num_layers))]
    for v in vllm_lines(draft):
        short = {"V2": "vLLM V2", "V1": "vLLM V1"}.get(v.runner, "vLLM")
        out.append((short, f"vLLM {v.title}", v.capture_layers(v.read_ids(draft), num_layers)))
    return out


def candidates(draft: DraftIds, provenance: Provenance, num_layers: int, num_aux: int,
               architecture: str = "", sglang_version: str = SGLANG_DEFAULT
               ) -> tuple[list[Candidate], list[str]]:
    """Every reading worth measuring (deduplicated by layers, labels merged), and
    notes on readings left out (outside [0, num_layers], a layer twice, or not
    ``num_aux`` layers: the draft's fc takes exactly that many). Readings are in
    ascending order, as the engines feed them, except the config-order ones."""
    found: dict[tuple, Candidate] = {}
    notes: list[str] = []

    def add(layers, label, config_reading=False, ordered=False):
        if layers is None:
            return
        layers = tuple(layers) if ordered else tuple(sorted(layers))
        if len(layers) != num_aux or len(set(layers)) != len(layers) \
                or not all(0 <= c <= num_layers for c in layers):
            notes.append(f"{label}: {list(layers)} left out (the draft takes {num_aux} distinct "
                         f"capture layers in [0, {num_layers}])")
            return
        cand = found.setdefault(layers, Candidate(layers, []))
        if label not in cand.labels:
            cand.labels.append(label)
        cand.config_reading |= config_reading

    readings = [r for r in provenance.readings if r.expected is not None]
    ids = provenance.ids
    for r in readings:
        add(r.expected, f"config: {r.label.split(' (')[0]}", config_reading=True)
        in_order = config_order(ids, r.expected)
        if in_order is not None:
            add(in_order, f"config: {r.label.split(' (')[0]}, slots in the config's order",
                config_reading=True, ordered=True)
    defaults = default_capture_layers(num_layers)
    if not readings:
        # No ids: the config's reading is what the engines feed it, their default.
        add(defaults, "config: no ids, the engines' default", config_reading=True)
    if ids is not None:
        add([i + 1 for i in ids], "ids read as outputs")
        add(list(ids), "ids read as inputs")
        add([i - 1 for i in ids], "ids read as inputs, all one lower")
        add([i + 2 for i in ids], "ids read as outputs, all one higher")
    for label, _, layers in _engine_captures(draft, num_layers, architecture, sglang_version):
        add(layers, label + " captures")
    add(defaults, "the engines' default")
    base = sorted(readings[0].expected) if readings else defaults
    for k in range(len(base)):
        for d in (-1, 1):
            moved = list(base)
            moved[k] += d
            add(moved, f"config, layer {base[k]} -> {base[k] + d}")
    return list(found.values()), notes


def config_order(ids, expected) -> Optional[tuple[int, ...]]:
    """The capture layers ``expected`` (ascending) in the order the config lists ``ids``,
    when that order is not ascending (None otherwise). Every reading moves all ids by
    one constant, so the k-th smallest id names the k-th capture layer."""
    if not ids or expected is None or list(ids) == sorted(ids) \
            or len(set(ids)) != len(ids) or len(ids) != len(expected):
        return None
    rank = {i: k for k, i in enumerate(sorted(ids))}
    return tuple(expected[rank[i]] for i in ids)


@dataclass
class ProbeReport:
    num_layers: int
    candidates: list[Candidate]
    provenance: Provenance
    threshold: float
    verdict: str = ""
    fixes: list[str] = field(default_factory=list)
    engines: list[str] = field(default_factory=list)
    ok: bool = False
    notes: list[str] = field(default_factory=list)
    measured: dict = field(default_factory=dict)   # where and how the target ran

    def to_json(self) -> dict:
        """The report as data: what a script checks (``--json``)."""
        return {"verdict": self.verdict.split(":")[0], "verdict_text": self.verdict,
                "ok": self.ok, "threshold": self.threshold, "num_layers": self.num_layers,
                "trainer": self.provenance.trainer, "ids": self.provenance.ids,
                "readings": [{"capture_layers": list(c.layers), "agreement": c.agreement,
                              "hits": c.hits, "tokens": c.tokens, "labels": c.labels,
                              "config_reading": c.config_reading} for c in self.ranked],
                "engines": self.engines, "fixes": self.fixes, "notes": self.notes,
                "measured": self.measured}

    @property
    def ranked(self) -> list[Candidate]:
        return sorted(self.candidates, key=lambda c: (-c.agreement, c.layers))

    def format(self) -> str:
        n = self.num_layers
        rows = [("", "capture layers (c = input of layer c)", "agree", "tokens", "reading")]
        for i, c in enumerate(self.ranked):
            mark = "*" if c.config_reading else " "
            rows.append((f"{i + 1}{mark}", c.describe(n), f"{100 * c.agreement:5.1f}%",
                         str(c.tokens), "; ".join(c.labels)))
        w = [max(len(r[j]) for r in rows) for j in range(4)]
        lines = ["  ".join(r[j].ljust(w[j]) for j in range(4)) + "  " + r[4] for r in rows]
        lines.append("(* the config's own reading; out X = the output of layer X; agree = the "
                     "draft's first token is the target's greedy next token)")
        lines.append("")
        lines += [wrap(self.verdict, "", "  ")]
        lines += [wrap(f, "  ", "    ") for f in self.fixes]
        lines += [wrap(e, "  ", "    ") for e in self.engines]
        lines += [wrap("note: " + t, "", "  ") for t in self.notes]
        return "\n".join(lines)


def _threshold(a: Candidate, b: Candidate, min_margin: float) -> float:
    """The margin that separates two agreements: ``min_margin``, or three standard
    errors of the difference when that is larger (few tokens)."""
    n = max(1, min(a.tokens, b.tokens))
    se = math.sqrt((a.agreement * (1 - a.agreement) + b.agreement * (1 - b.agreement)) / n)
    return max(min_margin, 3 * se)


def _fc_reorder(trained: list[int], spec, ids) -> str:
    """How to make a draft trained with its slots in ``trained`` order (capture layers,
    not ascending) take the engines' ascending feed: its fc is linear in the
    concatenated states, so permuting fc's input column blocks is exact; then the
    config's ``ids`` are written sorted."""
    ascending = sorted(trained)
    perm = [trained.index(c) for c in ascending]
    k = len(trained)
    width = f" of {spec.target_hidden_size} columns" if spec is not None else ""
    extra = ""
    if spec is not None and spec.norm_before_fc:
        extra += (f"; permute the {k} blocks of the weight of the norm before fc the same way "
                  f"(its RMS over the whole concatenation does not depend on the order)")
    if spec is not None and spec.fc_norm:
        extra += f"; reorder its {k} per-state fc norms the same way"
    return (f"fix the draft, not the ids: reorder the input columns of its fc.weight in {k} "
            f"blocks{width}, one per target state, so that the new blocks are the old blocks "
            f"{perm} in that order (new block j = old block {perm}[j]){extra}. fc is linear "
            f"in the concatenated states and nothing else in the draft sees them, so the "
            f"draft then computes from the engines' ascending feed {ascending} exactly what "
            f"it was trained to" + (f"; then write the ids sorted, {sorted(ids)}" if ids else "")
            + ". Or retrain the draft on the engines' order")


def judge(report: ProbeReport, draft: DraftIds, architecture: str, min_margin: float,
          sglang_version: str = "", draft_spec=None,
          engines: Sequence[str] = ("sglang", "vllm")) -> None:
    """The verdict, the ids to write and each engine's line, from the measured table.
    The config's reading stands unless another reading beats it by more than the
    noise (:func:`_threshold`); two config readings (ambiguous ids, or unsorted ids
    in ascending and in the config's slot order) must be told apart by that margin
    too. ``draft_spec`` (the draft's :class:`~eagle_capture.probe.draft.DraftSpec`)
    names the weights to reorder for a draft trained in the config's slot order;
    ``engines``: the engines whose lines are reported and decide ``ok``."""
    ranked = report.ranked
    best = ranked[0]
    n = report.num_layers
    config = [c for c in ranked if c.config_reading]
    top = config[0]
    need = _threshold(best, top, min_margin)
    report.threshold = need

    def pct(c):
        return f"{100 * c.agreement:.1f}%"

    want: Optional[list[int]] = None
    if best is not top and best.agreement - top.agreement >= need:
        want = list(best.layers)
        report.verdict = (
            f"MISMATCH: capture layers {want} agree {pct(best)}, "
            f"{100 * (best.agreement - top.agreement):.1f} points more than the config's "
            f"reading {list(top.layers)} ({pct(top)}; {100 * need:.1f} needed): the draft was "
            f"trained on {want}")
    elif len(config) > 1 and top.agreement - config[1].agreement < _threshold(
            top, config[1], min_margin):
        report.verdict = (
            f"INCONCLUSIVE: the config's readings {list(top.layers)} ({pct(top)}) and "
            f"{list(config[1].layers)} ({pct(config[1])}) are within "
            f"{100 * _threshold(top, config[1], min_margin):.1f} points over {top.tokens} "
            f"tokens: more calibration text (--prompts, --max-tokens) narrows it; a draft "
            f"that agrees little everywhere may not belong to this target")
    else:
        want = list(top.layers)
        which = "; ".join(lb for lb in top.labels if lb.startswith("config"))
        runner = next((c for c in ranked if c is not top), None)
        report.verdict = f"CONFIRMED: the draft was trained on capture layers {want}, the " \
                         f"config's reading ({which}): {pct(top)} agreement"
        if runner is not None:
            gap = top.agreement - runner.agreement
            report.verdict += (
                f", {100 * gap:.1f} points over the next reading {list(runner.layers)}"
                if gap >= 0 else
                f"; {list(runner.layers)} agrees {pct(runner)}, within the "
                f"{100 * need:.1f} points that noise allows")
        if report.provenance.ambiguous:
            conv = "output" if "output" in which else "input"
            report.fixes.append(
                f"the config's ids are ambiguous; this draft's are in the {conv} convention: "
                f"pass --id-convention {conv} to the doctor, EAGLE_CAPTURE_ID_CONVENTION={conv} "
                f"to the plugins")
    if want is None:
        report.ok = False
        return
    report.ok = want == list(top.layers)
    ids = report.provenance.ids
    in_order = want != sorted(want)
    if in_order:
        # Trained with the slots in the config's order: what no engine feeds.
        report.ok = False
        won = next(c for c in ranked if list(c.layers) == want)
        asc = next((c for c in ranked if list(c.layers) == sorted(want)), None)
        report.verdict = (
            f"MISMATCH: the draft was trained with its slots in the config's order, capture "
            f"layers {want} in that order ({pct(won)}"
            + (f"; ascending, {sorted(want)}, {pct(asc)}" if asc is not None else "")
            + f"): no engine can feed it so. SGLang and vLLM capture in ascending layer order "
              f"whatever the order of the ids, so no id list fixes it on either engine")
        report.fixes.append(_fc_reorder(want, draft_spec, ids))
        want = sorted(want)
    elif ids and slot_order_problem(ids) and want == list(top.layers):
        ordered = next((c for c in ranked if c.config_order), None)
        report.fixes.append(
            slot_order_problem(ids) + ". Measured: this draft takes its slots in ascending "
            f"order, as the engines feed them ({pct(top)}"
            + (f"; in the config's order {pct(ordered)}" if ordered is not None else "")
            + f"): write the ids sorted, {sorted(ids)}")
    sglang_version = sglang_version or SGLANG_DEFAULT
    line, _ = _sglang_line(architecture, sglang_version)
    sglang_ids = fix_ids(line, want, n, allow_embedding=0 in want)
    for _, label, layers in _engine_captures(draft, n, architecture, sglang_version):
        sglang = label.startswith("SGLang")
        if ("sglang" if sglang else "vllm") not in engines:
            continue
        cannot = cannot_load("sglang" if sglang else "vllm", draft, line if sglang else None)
        if cannot:
            # No class for the format: no ids help there (the doctor's words).
            report.ok = False
            report.engines.append(f"{label}: CANNOT LOAD -- {cannot}")
            continue
        # The target's class cannot capture there at all (the doctor's engine facts).
        stuck = target_cannot_capture("sglang" if sglang else "vllm",
                                      line if sglang else VLLM_LINE, architecture,
                                      sglang_version if sglang else None)
        if stuck is not None and stuck.whole:
            report.ok = False
            report.engines.append(f"{label}: CANNOT CAPTURE -- {stuck.text}")
            continue
        head = (f"{label} captures {sorted(layers)} in ascending order: PROBLEM -- no ids "
                f"feed slots in the config's order; with the draft's fc reordered (above), "
                if in_order else f"{label} captures {sorted(layers)}: ")
        if sorted(layers) == want:
            report.engines.append(head + ("it captures the right layers" if in_order
                                          else "OK"))
            continue
        report.ok = False
        if not sglang:
            fix = f"write the top-level eagle_aux_hidden_state_layer_ids = {want}"
        elif sglang_ids is None:
            fix = f"no ids make this line capture {want}"
        else:
            fix = f"write eagle_config.eagle_aux_hidden_state_layer_ids = {sglang_ids}"
        report.engines.append(head + (fix if in_order else f"PROBLEM -- {fix}"))


def _weights_bytes(folder: Path, dtype: torch.dtype) -> int:
    """The target's weights in ``dtype``: counted from the safetensors headers
    (no tensor read), else the files' size."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return sum(f.stat().st_size for f in folder.glob("*.bin"))
    from safetensors import safe_open
    numel = 0
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                numel += math.prod(h.get_slice(k).get_shape())
    return numel * torch.empty((), dtype=dtype).element_size()


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 // 10 else f"{n / 2**20:.1f} MiB"


def _available(device: torch.device) -> int:
    """Memory free for the target: the device's free memory, or the host's available
    memory (Linux's MemAvailable counts reclaimable page cache; free pages alone do not)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def read_prompts(path: Optional[str], vocab_size: Optional[int] = None) -> list[dict]:
    """Calibration prompts: a JSON-lines file of {"text": ...} or {"token_ids": [...]}
    (a plain text file: one prompt per paragraph); default: the package's own. Token
    ids must be in [0, ``vocab_size``) when it is given (the target's embedding would
    fail on any other, after the model is loaded)."""
    if path is None:
        text = resources.files("eagle_capture.probe").joinpath("prompts.jsonl").read_text()
        where = "the default calibration prompts"
    else:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ProbeError(f"--prompts {path}: {exc.strerror}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is None or "\0" in text:    # NUL is valid UTF-8 but in no text file
            raise ProbeError(f"--prompts {path}: not a text file (binary content); give a "
                             f".jsonl of {{\"text\": ...}} or {{\"token_ids\": [...]}}, or a "
                             f"UTF-8 text file") from None
        where = path
    prompts = []
    if path is None or path.endswith(".jsonl"):
        for i, line in enumerate(text.splitlines()):
            if not line.strip():
                continue
            try:
                p = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ProbeError(f"{where} line {i + 1}: not JSON ({exc})") from None
            if not isinstance(p, dict) or not (isinstance(p.get("text"), str) or (
                    isinstance(p.get("token_ids"), list)
                    and all(isinstance(t, int) and not isinstance(t, bool)
                            for t in p["token_ids"]))):
                raise ProbeError(f"{where} line {i + 1}: expected {{\"text\": ...}} or "
                                 f"{{\"token_ids\": [...]}}")
            if "token_ids" in p:
                out_of_vocab(p["token_ids"], vocab_size, f"{where} line {i + 1}")
            prompts.append(p)
    else:
        prompts = [{"text": para.strip()} for para in text.split("\n\n") if para.strip()]
    if not prompts:
        raise ProbeError(f"{where}: no prompts")
    return prompts


def out_of_vocab(tokens: Sequence[int], vocab_size: Optional[int], where: str) -> None:
    """Refuses a token id outside [0, ``vocab_size``) (no check when it is unknown)."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool):
        return
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ProbeError(f"{where}: token id {bad[0]} is outside the target's vocabulary "
                         f"(ids 0 - {vocab_size - 1}: vocab_size in its config.json)"
                         + (f", and {len(bad) - 1} more" if len(bad) > 1 else ""))


# The key names vLLM reads a model's KV-head count from, in its order, the attention
# heads when none is there (ModelArchConfigConvertor.get_total_num_kv_heads, vllm 0.32.0).
_KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num",
                 "num_attention_groups")


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
        return (f"the target's {heads} attention heads do not divide over {tp} ranks ({engine} "
                f"requires num_attention_heads % tensor_parallel_size == 0)")
    if "kv_lora_rank" in text_config:
        return None
    kv = next((text_config[k] for k in _KV_HEAD_KEYS if text_config.get(k) is not None), heads)
    if isinstance(kv, int) and not isinstance(kv, bool) and kv > 0 and \
            (tp % kv if tp >= kv else kv % tp):
        return (f"the target's {kv} KV heads and {tp} ranks: {engine} needs one to divide the "
                f"other (each rank holds whole KV heads)")
    return None


def _text_config(folder: Path) -> dict:
    """The target's config.json (a multimodal target's text model's ``text_config``)."""
    loaded, _ = load_config(folder / "config.json", "target config")
    text = loaded.get("text_config")
    return text if isinstance(text, dict) else loaded


def json_problem(path: str) -> Optional[str]:
    """Why ``--json`` cannot be written (tried now, not after the run), or None. An
    existing file is opened for appending (left as it is), a new one made and removed."""
    p = Path(path)
    if p.is_dir():
        return "is a directory"
    try:
        if p.exists():
            open(p, "a").close()
        else:
            open(p, "x").close()
            p.unlink()
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _load_target(folder: Path, device, dtype):
    import transformers
    kwargs = ({"dtype": dtype} if int(transformers.__version__.split(".")[0]) >= 5
              else {"torch_dtype": dtype})
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ProbeError(f"--target {folder}: transformers cannot load it as a causal LM "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0]})") from None
    return model.to(device).eval()


def _device(device: str) -> torch.device:
    """``--device``: the CPU or a CUDA device that is here."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ProbeError(f"--device {device}: the probe runs on cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ProbeError(f"--device {device}: no CUDA device here (--device cpu runs it on "
                             f"the CPU)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ProbeError(f"--device {device}: there are {torch.cuda.device_count()} CUDA "
                             f"devices here")
    return dev


def _states_bytes(keep, max_tokens: int, hidden: int, itemsize: int) -> int:
    return len(keep) * max_tokens * (hidden or 0) * itemsize


def _transformers_target(target_dir: Path, dev, torch_dtype, tmodel, keep, dtype: str,
                         max_tokens: int, plan: str, log):
    """The target in transformers on one device, the plan logged first (refused with the
    numbers when it does not fit): a function of a prompt's tokens -> (states, greedy
    tokens, the target's embeddings)."""
    from eagle_capture.probe.target import decoder_layers, target_states

    weights = _weights_bytes(target_dir, torch_dtype)
    need = int(1.2 * weights) + _states_bytes(keep, max_tokens, tmodel.hidden_size,
                                              torch_dtype.itemsize)
    free = _available(dev)
    log(f"probe: {plan}; needs ~{_size(need)} on {dev} ({_size(weights)} of weights in "
        f"{dtype}), {_size(free)} free")
    if need > free:
        raise ProbeError(f"the target needs ~{_size(need)} in {dtype} on {dev}, "
                         f"{_size(free)} are free: a target this size does not fit one "
                         f"device (the probe runs the whole target on one); use a machine with "
                         f"more memory, --dtype bf16, or --engine vllm --tp N to run it in "
                         f"vLLM's engine over N GPUs")
    model = _load_target(target_dir, dev, torch_dtype)
    layers = decoder_layers(model, tmodel.num_layers)
    embed = model.get_input_embeddings()

    def run(tokens):
        ids = torch.tensor([tokens], device=dev)
        states, greedy = target_states(model, layers, ids, keep)
        return states, greedy, embed(ids)
    return run


def run_probe(target: str, draft: str, prompts: Optional[str] = None, device: str = "cpu",
              dtype: str = "fp32", max_tokens: int = 512, convention: str = "auto",
              min_margin: float = 0.03, log=print, progress: bool = True,
              sglang_version: Optional[str] = None, engine: str = "transformers",
              tp: int = 1, engine_args: Optional[dict] = None,
              engine_target=None) -> ProbeReport:
    """Measure every candidate reading (see the module's docstring); ``log`` gets the
    plan (memory, tokens) before the target is loaded. ``engine="vllm"``: the target in
    vLLM's engine at tensor parallel ``tp`` (:mod:`eagle_capture.probe.engine`; ``dtype``
    may be ``"auto"``: the checkpoint's, as vLLM serves it); ``engine="sglang"``: in
    SGLang's engine (:mod:`eagle_capture.probe.sglang_engine`), SGLang's lines shown for
    the installed version; ``engine_target``: a started
    :class:`~eagle_capture.probe.engine.VllmTarget` or
    :class:`~eagle_capture.probe.sglang_engine.SglangTarget` to use (and leave running)."""
    if engine_target is not None:
        engine = getattr(engine_target, "engine_name", "vllm")
    target_dir, draft_dir = Path(target), Path(draft)
    for name, d in (("--target", target_dir), ("--draft", draft_dir)):
        if not (d / "config.json").is_file():
            raise ProbeError(f"{name} {d}: no config.json there (pass the model's folder)")
    if engine not in ENGINES:
        raise ProbeError(f"--engine must be one of {list(ENGINES)}, got {engine!r}")
    dtypes = sorted(DTYPES) + (["auto"] if engine in ENGINE_WORDS else [])
    if dtype not in dtypes:
        raise ProbeError(f"--dtype must be one of {dtypes} with --engine {engine}, got "
                         f"{dtype!r}")
    if tp < 1 or (tp > 1 and engine not in ENGINE_WORDS):
        raise ProbeError(f"--tp {tp}: a tensor-parallel size >= 1, and only with --engine vllm "
                         f"or sglang (transformers runs the target on one device)")
    dev = _device(device)
    try:
        tmodel = read_target(target_dir / "config.json")
        ids = read_draft_ids(draft_dir / "config.json")
        text_config = _text_config(target_dir)
        check_draft_class(load_config(draft_dir / "config.json", "draft config")[0],
                          f"--draft {draft_dir}")
    except (CapturePlanError, DraftError) as exc:
        raise ProbeError(str(exc)) from None
    n, arch = tmodel.num_layers, tmodel.architecture
    # All the input is checked before anything is loaded or run: a bad option or prompt
    # file costs the user no draft load, no engine start, no model load.
    if engine in ENGINE_WORDS and engine_target is None:
        split = tp_problem(text_config, tp, ENGINE_WORDS[engine])
        if split:
            raise ProbeError(f"--tp {tp}: {split}: {ENGINE_WORDS[engine]} cannot serve the "
                             f"target at tensor parallel {tp}")
        try:
            if engine == "vllm":
                check_vllm()
            else:
                from eagle_capture.probe.sglang_engine import check_sglang
                sglang_version = check_sglang(sglang_version, arch, tp)
        except EngineError as exc:
            raise ProbeError(str(exc)) from None
    elif engine == "sglang":
        sglang_version = sglang_version or engine_target.version
    sglang_version = sglang_version or SGLANG_DEFAULT
    try:
        _, rule_notes = _sglang_line(arch, sglang_version)
    except CapturePlanError as exc:
        raise ProbeError(f"--sglang-version: {exc}") from None
    vocab = text_config.get("vocab_size")
    prompt_list = read_prompts(prompts, vocab)
    tokenizer = None
    if any("token_ids" not in p for p in prompt_list):
        try:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        except (OSError, ValueError) as exc:
            raise ProbeError(f"text prompts need the target's tokenizer, which did not load from "
                             f"{target_dir} ({type(exc).__name__}); give --prompts a .jsonl "
                             f"of {{\"token_ids\": [...]}}") from None
    token_lists = []
    for i, p in enumerate(prompt_list):
        if "token_ids" in p:
            tokens = p["token_ids"]
        else:
            tokens = tokenizer(p["text"], add_special_tokens=True)["input_ids"]
            out_of_vocab(tokens, vocab, f"{prompts or 'the default calibration prompts'}: "
                                        f"prompt {i + 1}, tokenized")
        token_lists.append(list(tokens[:max_tokens]))
    provenance = recognise(ids, n, arch, convention)
    # The draft's dtype; "auto" (the engine's choice for the target) runs it as the device's
    # default, bf16 on a GPU, fp32 on the CPU.
    torch_dtype = DTYPES.get(dtype) or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    try:
        dmodel = load_draft(draft_dir, "cpu", torch_dtype, target_hidden=tmodel.hidden_size,
                            engine=engine)
    except DraftError as exc:
        raise ProbeError(str(exc)) from None
    cands, notes = candidates(ids, provenance, n, dmodel.spec.num_aux, arch, sglang_version)
    notes = rule_notes + getattr(dmodel, "notes", []) + notes
    if not cands:
        raise ProbeError(f"no reading of the draft's ids gives {dmodel.spec.num_aux} capture "
                         f"layers in [0, {n}]: " + "; ".join(notes))
    keep = sorted({c for cand in cands for c in cand.layers})
    log(f"probe: target {target_dir} ({arch}, {n} layers, hidden {tmodel.hidden_size}); draft "
        f"{draft_dir} ({dmodel.spec.format}, {dmodel.spec.num_aux} states in)")
    plan = f"{len(cands)} readings over {len(prompt_list)} prompts (<= {max_tokens} tokens each)"
    owned = None
    try:
        if engine in ENGINE_WORDS:
            target_run, owned, measured = _engine_target(
                target_dir, tmodel, keep, tp, dtype, max_tokens, engine_args, engine_target,
                dev, dmodel, plan, log, engine, sglang_version)
        else:
            target_run = _transformers_target(target_dir, dev, torch_dtype, tmodel, keep, dtype,
                                              max_tokens, plan, log)
            measured = {"engine": "transformers", "device": str(dev), "dtype": dtype}
        dmodel = dmodel.to(dev)
        bar = _progress(len(prompt_list), progress)
        started, scored, first = time.monotonic(), 0, 0.0
        with torch.no_grad():
            for tokens in token_lists:
                if len(tokens) < 3:
                    bar.update(1)
                    continue
                states, greedy, embeds = target_run(tokens)
                if dmodel.embed_tokens is not None:
                    embeds = dmodel.embed_tokens(torch.tensor([tokens], device=dev))
                agree = score_readings(dmodel, states, greedy, embeds,
                                       [c.layers for c in cands])
                for cand in cands:
                    cand.hits += int(agree[cand.layers].sum())
                    cand.tokens += int(agree[cand.layers].numel())
                # The first prompt pays one-time costs (kernel builds, the engine's graph
                # warm-up: 5.6 s in vLLM on an H100, ~0.1 s per prompt after it), so the
                # estimate for the rest is the second prompt's time.
                scored += 1
                if scored == 1:
                    first = time.monotonic() - started
                elif scored == 2:
                    took = time.monotonic() - started - first
                    log(f"probe: the first prompt took {first:.1f} s (one-time warm-up "
                        f"included), the second {took:.2f} s: about "
                        f"{first + took * (len(prompt_list) - 1):.0f} s for all "
                        f"{len(prompt_list)}")
                bar.update(1)
        bar.close()
        if engine in ENGINE_WORDS:
            notes += _engine_notes(owned or engine_target, measured)
    finally:
        if owned is not None:
            owned.close()
    if not any(c.tokens for c in cands):
        raise ProbeError("no prompt had 3 tokens or more")
    report = ProbeReport(n, cands, provenance, 0.0, notes=notes, measured=measured)
    judge(report, ids, arch, min_margin, sglang_version, draft_spec=dmodel.spec,
          engines=(engine,) if engine in ENGINE_WORDS else ("sglang", "vllm"))
    where = (f"{ENGINE_WORDS[engine]}'s engine at tensor parallel {measured['tp']}"
             if engine in ENGINE_WORDS else dev)
    log(f"probe: measured in {time.monotonic() - started:.1f} s in {where} ({dtype})")
    return report


def _engine_target(target_dir: Path, tmodel, keep, tp: int, dtype: str, max_tokens: int,
                   engine_args, engine_target, dev, dmodel, plan: str, log,
                   engine: str = "vllm", sglang_version: str = ""):
    """The target in vLLM's or SGLang's engine (started here unless ``engine_target`` is
    given): the plan logged first, then (run, the target to close or None, what was
    measured)."""
    from eagle_capture.probe.engine import VllmTarget, kv_cache_bytes
    from eagle_capture.probe.sglang_engine import SglangTarget, stated_settings

    hidden = tmodel.hidden_size or 0
    tp = engine_target.tp if engine_target is not None else tp
    itemsize = DTYPES[dtype].itemsize if dtype in DTYPES else _checkpoint_itemsize(target_dir)
    on_disk = sum(f.stat().st_size for f in target_dir.glob("*.safetensors"))
    per_rank = _states_bytes(keep, max_tokens, hidden, itemsize)
    host = per_rank + _states_bytes(keep, max_tokens, hidden, 4)
    words = ENGINE_WORDS[engine]
    cache = (f"a KV cache of {_size(kv_cache_bytes(tmodel.num_layers, hidden, max_tokens))} "
             f"per rank" if engine == "vllm" else
             f"a KV cache pool of {max_tokens + 1024} tokens (max_total_tokens)")
    where = ("on its device, this process rank 0's on the host" if engine == "vllm" else
             "and copies them to the host; rank 0's pass through a side channel in "
             "/dev/shm (or the temporary directory) to this process")
    log(f"probe: {plan}; the target in {words}'s engine at tensor parallel {tp}, dtype {dtype}: "
        f"{_size(on_disk)} of weights on disk (~{_size(on_disk // tp)} per rank, as {words} "
        f"loads them) and {cache} (one prompt at a time); per prompt each rank keeps "
        f"{len(keep)} states of <= {max_tokens} tokens x {hidden} ({_size(per_rank)}) "
        f"{where}, with the draft's inputs (~{_size(host)}); the draft "
        f"({_size(sum(p.numel() * p.element_size() for p in dmodel.parameters()))}) on {dev}")
    if engine == "sglang":
        log(f"probe: SGLang {sglang_version} runs with the settings the capture needs: "
            f"{stated_settings(sglang_version)}; the first prompt includes the engine's "
            f"warm-up, the time for all prompts is estimated after the second")
    owned = None
    if engine_target is None:
        t0 = time.monotonic()
        try:
            if engine == "vllm":
                engine_target = owned = VllmTarget(target_dir, tmodel.num_layers, hidden, keep,
                                                   tp=tp, dtype=dtype, max_tokens=max_tokens,
                                                   engine_args=engine_args)
            else:
                engine_target = owned = SglangTarget(target_dir, tmodel.num_layers, hidden,
                                                     keep, tp=tp, dtype=dtype,
                                                     max_tokens=max_tokens,
                                                     engine_args=engine_args,
                                                     version=sglang_version)
        except EngineError as exc:
            raise ProbeError(str(exc)) from None
        log(f"probe: {words} served the target in {time.monotonic() - t0:.0f} s "
            f"({engine_target.tp} rank{'s' if engine_target.tp > 1 else ''}, "
            f"on {engine_target.device})")
    engine_target.reset_counts()
    missing = sorted(set(keep) - set(engine_target.keep))
    if missing:
        raise ProbeError(f"the engine's capture does not hold capture layers {missing}")

    def run(tokens):
        try:
            states, greedy, embeds = engine_target.run(tokens)
        except EngineError as exc:
            raise ProbeError(str(exc)) from None
        return ({c: s.to(dev) for c, s in states.items()}, greedy.to(dev), embeds.to(dev))
    measured = {"engine": engine, "tp": engine_target.tp, "dtype": dtype,
                "device": engine_target.device, "hidden_size": hidden}
    if engine == "sglang":
        measured["sglang_version"] = sglang_version
    return run, owned, measured


def _engine_notes(target, measured: dict) -> list[str]:
    measured.update(ranks_checked=len(target.ranks), prompts=target.prompts,
                    max_rank_difference=target.worst_rank_difference,
                    engine_token_differs=target.engine_disagreements)
    words = ENGINE_WORDS[measured["engine"]]
    notes = [f"measured in {words}'s engine at tensor parallel {target.tp}: every rank's "
             f"captured states are {measured['hidden_size']} wide (the full hidden size) and "
             f"equal to rank 0's (largest relative difference "
             f"{target.worst_rank_difference:.2g}) over {target.prompts} prompts"]
    if getattr(target, "other_forwards", 0):
        measured["other_forwards"] = target.other_forwards
        notes.append(f"{words} ran {target.other_forwards} forwards of other tokens than the "
                     f"prompts' (of its own, one token each on the lines seen): not scored")
    if target.engine_disagreements:
        notes.append(f"{words}'s own sampled token differs from the probe's greedy token at the "
                     f"last position in {target.engine_disagreements} of {target.prompts} "
                     f"prompts (near-ties in the logits: computed over other rows)")
    return notes


def _checkpoint_itemsize(folder: Path) -> int:
    """Bytes per element of the checkpoint's dtype (its config's), 2 when unsaid."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return 2
    name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return 4 if "32" in name else 2


@torch.no_grad()
def score_readings(draft, states: dict, greedy: torch.Tensor, embeds: torch.Tensor,
                   readings: Sequence[tuple[int, ...]]) -> dict:
    """For each reading (capture layers), whether the draft's first step at each
    position t (the target's states at t, the token at t + 1) proposes the target's
    greedy token at t + 1: {layers: bool [T - 1]}, from the target's ``states``
    ({c: [1, T, H]}), its ``greedy`` next tokens [1, T] and the draft's ``embeds``
    [1, T, H] of the prompt's tokens."""
    greedy = greedy[0]
    dtype = next(draft.parameters()).dtype
    embeds = embeds[:, 1:].to(dtype)
    positions = torch.arange(greedy.shape[0] - 1, device=greedy.device).unsqueeze(0)
    out = {}
    for r in readings:
        aux = torch.cat([states[c][:, :-1] for c in r], dim=-1).to(dtype)
        proposed = draft.to_target(draft(aux, embeds, positions)[0].argmax(-1))
        out[tuple(r)] = proposed == greedy[1:]
    return out


@torch.no_grad()
def first_step_agreement(model, layers, draft, embed, tokens: torch.Tensor,
                         readings: Sequence[tuple[int, ...]]) -> dict:
    """:func:`score_readings` for a transformers ``model`` (its decoder ``layers``) on
    ``tokens`` [1, T], the draft's embeddings from ``embed``."""
    from eagle_capture.probe.target import target_states

    keep = sorted({c for r in readings for c in r})
    states, greedy = target_states(model, layers, tokens, keep)
    return score_readings(draft, states, greedy, embed(tokens), readings)


class _NoBar:
    n = 0

    def update(self, k):
        self.n += k

    def close(self):
        pass


def _progress(total: int, on: bool):
    if not on:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="probe: prompts", file=sys.stderr, leave=False)


class _Parser(argparse.ArgumentParser):
    """Bad options: one line on stderr and exit 2 (not the usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def _engine_arg(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` for vLLM's ``LLM(...)`` or SGLang's ``Engine(...)``: the value as JSON
    when it parses, else text."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (e.g. "
                                         f"gpu_memory_utilization=0.85)")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="eagle-capture probe",
        description="Measure which target layers an EAGLE-3 draft was trained on: its first "
                    "step's agreement with the target for every reading of its ids.")
    p.add_argument("--target", required=True, help="the target model's folder (HF format)")
    p.add_argument("--draft", required=True, help="the EAGLE-3 draft's folder")
    p.add_argument("--prompts", help="calibration prompts: .jsonl of {\"text\"} or "
                                     "{\"token_ids\"}, or a text file (one prompt per "
                                     "paragraph); default: the package's own")
    p.add_argument("--engine", choices=ENGINES, default="transformers",
                   help="where the target runs: transformers on one device (default), or "
                        "vLLM's or SGLang's engine as it serves the target (--tp, its dtype, "
                        "quantisation); an engine's run answers for that engine's lines")
    p.add_argument("--tp", type=int, default=1,
                   help="--engine vllm|sglang: the tensor-parallel size the target is served "
                        "with")
    p.add_argument("--engine-arg", action="append", type=_engine_arg, default=[],
                   metavar="KEY=VALUE",
                   help="--engine vllm|sglang: another argument of vLLM's LLM(...) or "
                        "SGLang's Engine(...) (repeatable; e.g. quantization=fp8, "
                        "trust_remote_code=true)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="where the target (transformers) and the draft run: cpu, cuda, cuda:N")
    p.add_argument("--dtype", choices=sorted(DTYPES) + ["auto"], default=None,
                   help="default: with --engine vllm|sglang auto (the checkpoint's, as the "
                        "engine serves it); else bf16 on cuda, fp32 on cpu")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per prompt (default 512)")
    p.add_argument("--id-convention", choices=CONVENTIONS, default="auto",
                   help="how the config's ids are read (default: from the trainer's markers)")
    p.add_argument("--sglang-version", default=None,
                   help=f"the SGLang version whose capture is shown (default {SGLANG_DEFAULT}; "
                        f"with --engine sglang the installed one)")
    p.add_argument("--json", metavar="FILE",
                   help="also write the table, the verdict and each engine's line here")
    p.add_argument("--min-margin", type=float, default=0.03,
                   help="the agreement margin (fraction) that decides (default 0.03)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    bad = ("--max-tokens must be >= 3" if args.max_tokens < 3 else
           "--min-margin must be in [0, 1)" if not 0 <= args.min_margin < 1 else
           "--tp and --engine-arg need --engine vllm or sglang"
           if args.engine not in ENGINE_WORDS and (args.tp != 1 or args.engine_arg) else "")
    if args.engine == "sglang":
        from eagle_capture.probe.sglang_engine import fixed_arg
        fixed = [f"{key} ({fixed_arg(key)})" for key in dict(args.engine_arg) if fixed_arg(key)]
    else:
        fixed = [f"{key} ({why})" for key, why in FIXED_ARGS.items()
                 if key in dict(args.engine_arg)]
    if fixed and not bad:
        bad = f"--engine-arg {', '.join(fixed)}: set by the probe"
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    unwritable = json_problem(args.json) if args.json else None
    if unwritable:
        print(f"error: --json {args.json}: {unwritable}", file=sys.stderr)
        return 2
    dtype = args.dtype or ("auto" if args.engine in ENGINE_WORDS else
                           "bf16" if args.device.startswith("cuda") else "fp32")
    try:
        report = run_probe(args.target, args.draft, args.prompts, args.device, dtype,
                           args.max_tokens, args.id_convention, args.min_margin,
                           log=lambda s: print(s, file=sys.stderr),
                           sglang_version=args.sglang_version, engine=args.engine, tp=args.tp,
                           engine_args=dict(args.engine_arg))
    except ProbeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(wrap(report.provenance.describe(), "", "  "))
    print()
    print(report.format())
    if args.json:
        try:
            Path(args.json).write_text(json.dumps(report.to_json(), indent=1) + "\n")
        except OSError as exc:
            print(f"error: --json {args.json}: {exc.strerror}", file=sys.stderr)
            return 2
    return 0 if report.ok else 1
