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

This module checks the input and runs the target and the draft (:func:`run_probe`);
the target's runners, one interface for all three, are :mod:`.runners`, the readings and
their scoring :mod:`.readings`, the verdict :mod:`.verdict`, the command line
:mod:`eagle_capture.cli.probe`.

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

import json
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence

import torch

from eagle_capture.layer_ids.lines import CapturePlanError, load_config, read_draft_ids, read_target
from eagle_capture.layer_ids.trainers import recognise
from eagle_capture.probe.draft import DraftError, check_draft_class, load_draft
from eagle_capture.probe.engine import VllmTarget
from eagle_capture.probe.readings import SGLANG_DEFAULT, _sglang_line, candidates, score_readings
from eagle_capture.probe.runners import DTYPES, EngineError, EngineRunner, Setup
from eagle_capture.probe.sglang_engine import SglangTarget
from eagle_capture.probe.target import TransformersTarget
from eagle_capture.probe.verdict import ProbeReport, judge

__all__ = ["RUNNERS", "ProbeError", "run_probe"]

# Where the target runs (--engine): Hugging Face transformers on one device, or an
# engine (whose lines alone the report then answers for); each a
# :class:`~eagle_capture.probe.runners.TargetRunner`.
RUNNERS = {"transformers": TransformersTarget, "vllm": VllmTarget, "sglang": SglangTarget}
ENGINES = tuple(RUNNERS)
ENGINE_WORDS = {
    name: runner.words for name, runner in RUNNERS.items() if issubclass(runner, EngineRunner)
}


class ProbeError(ValueError):
    """Input the probe cannot use: the message says what and why."""


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
        if text is None or "\0" in text:  # NUL is valid UTF-8 but in no text file
            raise ProbeError(
                f"--prompts {path}: not a text file (binary content); give a "
                f'.jsonl of {{"text": ...}} or {{"token_ids": [...]}}, or a '
                f"UTF-8 text file"
            ) from None
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
            if not isinstance(p, dict) or not (
                isinstance(p.get("text"), str)
                or (
                    isinstance(p.get("token_ids"), list)
                    and all(isinstance(t, int) and not isinstance(t, bool) for t in p["token_ids"])
                )
            ):
                raise ProbeError(
                    f'{where} line {i + 1}: expected {{"text": ...}} or {{"token_ids": [...]}}'
                )
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
        raise ProbeError(
            f"{where}: token id {bad[0]} is outside the target's vocabulary "
            f"(ids 0 - {vocab_size - 1}: vocab_size in its config.json)"
            + (f", and {len(bad) - 1} more" if len(bad) > 1 else "")
        )


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
            raise ProbeError(
                f"--device {device}: no CUDA device here (--device cpu runs it on the CPU)"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ProbeError(
                f"--device {device}: there are {torch.cuda.device_count()} CUDA devices here"
            )
    return dev


def run_probe(
    target: str,
    draft: str,
    prompts: Optional[str] = None,
    device: str = "cpu",
    dtype: str = "fp32",
    max_tokens: int = 512,
    convention: str = "auto",
    min_margin: float = 0.03,
    log=print,
    progress: bool = True,
    sglang_version: Optional[str] = None,
    engine: str = "transformers",
    tp: int = 1,
    engine_args: Optional[dict] = None,
    engine_target=None,
) -> ProbeReport:
    """Measure every candidate reading (see the module's docstring); ``log`` gets the
    plan (memory, tokens) before the target is loaded. ``engine="vllm"``: the target in
    vLLM's engine at tensor parallel ``tp`` (:mod:`eagle_capture.probe.engine`; ``dtype``
    may be ``"auto"``: the checkpoint's, as vLLM serves it); ``engine="sglang"``: in
    SGLang's engine (:mod:`eagle_capture.probe.sglang_engine`), SGLang's lines shown for
    the installed version; ``engine_target``: a started runner
    (:class:`~eagle_capture.probe.runners.TargetRunner`, e.g. a
    :class:`~eagle_capture.probe.engine.VllmTarget`) to use (and leave running)."""
    if engine_target is not None:
        engine = engine_target.engine_name
    target_dir, draft_dir = Path(target), Path(draft)
    for name, d in (("--target", target_dir), ("--draft", draft_dir)):
        if not (d / "config.json").is_file():
            raise ProbeError(f"{name} {d}: no config.json there (pass the model's folder)")
    if engine not in ENGINES:
        raise ProbeError(f"--engine must be one of {list(ENGINES)}, got {engine!r}")
    dtypes = sorted(DTYPES) + (["auto"] if engine in ENGINE_WORDS else [])
    if dtype not in dtypes:
        raise ProbeError(f"--dtype must be one of {dtypes} with --engine {engine}, got {dtype!r}")
    if tp < 1 or (tp > 1 and engine not in ENGINE_WORDS):
        raise ProbeError(
            f"--tp {tp}: a tensor-parallel size >= 1, and only with --engine vllm "
            f"or sglang (transformers runs the target on one device)"
        )
    dev = _device(device)
    try:
        tmodel = read_target(target_dir / "config.json")
        ids = read_draft_ids(draft_dir / "config.json")
        text_config = _text_config(target_dir)
        check_draft_class(
            load_config(draft_dir / "config.json", "draft config")[0], f"--draft {draft_dir}"
        )
    except (CapturePlanError, DraftError) as exc:
        raise ProbeError(str(exc)) from None
    n, arch = tmodel.num_layers, tmodel.architecture
    # All the input is checked before anything is loaded or run: a bad option or prompt
    # file costs the user no draft load, no engine start, no model load.
    # (a runner the caller started plans as its own class: a subclass may differ)
    runner_class = RUNNERS[engine] if engine_target is None else type(engine_target)
    if engine_target is None:
        try:
            sglang_version = runner_class.check(
                text_config, arch, tp, sglang_version, dtype, engine_args
            )
        except EngineError as exc:
            raise ProbeError(str(exc)) from None
    else:
        sglang_version = sglang_version or engine_target.version
        tp = engine_target.tp
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
            raise ProbeError(
                f"text prompts need the target's tokenizer, which did not load from "
                f"{target_dir} ({type(exc).__name__}); give --prompts a .jsonl "
                f'of {{"token_ids": [...]}}'
            ) from None
    token_lists = []
    for i, p in enumerate(prompt_list):
        if "token_ids" in p:
            tokens = p["token_ids"]
        else:
            tokens = tokenizer(p["text"], add_special_tokens=True)["input_ids"]
            out_of_vocab(
                tokens,
                vocab,
                f"{prompts or 'the default calibration prompts'}: prompt {i + 1}, tokenized",
            )
        token_lists.append(list(tokens[:max_tokens]))
    provenance = recognise(ids, n, arch, convention)
    # The draft's dtype; "auto" (the engine's choice for the target) runs it as the device's
    # default, bf16 on a GPU, fp32 on the CPU.
    torch_dtype = DTYPES.get(dtype) or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    try:
        dmodel = load_draft(
            draft_dir, "cpu", torch_dtype, target_hidden=tmodel.hidden_size, engine=engine
        )
    except DraftError as exc:
        raise ProbeError(str(exc)) from None
    cands, notes = candidates(ids, provenance, n, dmodel.spec.num_aux, arch, sglang_version)
    notes = rule_notes + getattr(dmodel, "notes", []) + notes
    if not cands:
        raise ProbeError(
            f"no reading of the draft's ids gives {dmodel.spec.num_aux} capture "
            f"layers in [0, {n}]: " + "; ".join(notes)
        )
    keep = sorted({c for cand in cands for c in cand.layers})
    log(
        f"probe: target {target_dir} ({arch}, {n} layers, hidden {tmodel.hidden_size}); draft "
        f"{draft_dir} ({dmodel.spec.format}, {dmodel.spec.num_aux} states in)"
    )
    setup = Setup(
        target_dir,
        tmodel,
        keep,
        dev,
        dtype,
        max_tokens,
        tp=tp,
        engine_args=engine_args,
        sglang_version=sglang_version,
        draft_bytes=sum(p.numel() * p.element_size() for p in dmodel.parameters()),
        plan=f"{len(cands)} readings over {len(prompt_list)} prompts (<= {max_tokens} tokens each)",
    )
    # Pick a runner, ask it for the states per prompt, close it (one the caller started
    # is left running).
    runner, owned = engine_target, None
    try:
        try:
            runner_class.plan(setup, log)
            if runner is None:
                runner = owned = runner_class.start(setup, log)
        except EngineError as exc:
            raise ProbeError(str(exc)) from None
        runner.reset_counts()
        missing = sorted(set(keep) - set(runner.keep))
        if missing:
            raise ProbeError(f"the engine's capture does not hold capture layers {missing}")
        measured = runner.measured(setup)
        dmodel = dmodel.to(dev)
        bar = _progress(len(prompt_list), progress)
        started, scored, first = time.monotonic(), 0, 0.0
        with torch.no_grad():
            for tokens in token_lists:
                if len(tokens) < 3:
                    bar.update(1)
                    continue
                try:
                    states, greedy, embeds = runner.run(tokens)
                except EngineError as exc:
                    raise ProbeError(str(exc)) from None
                states = {c: s.to(dev) for c, s in states.items()}
                greedy, embeds = greedy.to(dev), embeds.to(dev)
                if dmodel.embed_tokens is not None:
                    embeds = dmodel.embed_tokens(torch.tensor([tokens], device=dev))
                agree = score_readings(dmodel, states, greedy, embeds, [c.layers for c in cands])
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
                    log(
                        f"probe: the first prompt took {first:.1f} s (one-time warm-up "
                        f"included), the second {took:.2f} s: about "
                        f"{first + took * (len(prompt_list) - 1):.0f} s for all "
                        f"{len(prompt_list)}"
                    )
                bar.update(1)
        bar.close()
        notes += runner.notes(measured)
    finally:
        if owned is not None:
            owned.close()
    if not any(c.tokens for c in cands):
        raise ProbeError("no prompt had 3 tokens or more")
    report = ProbeReport(n, cands, provenance, 0.0, notes=notes, measured=measured)
    judge(
        report,
        ids,
        arch,
        min_margin,
        sglang_version,
        draft_spec=dmodel.spec,
        engines=runner.answers_for,
    )
    log(f"probe: measured in {time.monotonic() - started:.1f} s in {runner.where()} ({dtype})")
    return report


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
