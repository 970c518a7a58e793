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
the readings and their scoring are :mod:`.readings`, the verdict :mod:`.verdict`, the
command line :mod:`eagle_capture.cli.probe`.

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
import math
import os
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence

import torch

from eagle_capture.layer_ids.lines import CapturePlanError, load_config, read_draft_ids, read_target
from eagle_capture.layer_ids.trainers import recognise
from eagle_capture.probe.draft import DraftError, check_draft_class, load_draft
from eagle_capture.probe.engine import EngineError, check_vllm
from eagle_capture.probe.readings import SGLANG_DEFAULT, _sglang_line, candidates, score_readings
from eagle_capture.probe.verdict import ProbeReport, judge

__all__ = ["ProbeError", "run_probe"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Where the target runs: Hugging Face transformers on one device, or an engine (whose
# lines alone the report then answers for).
ENGINES = ("transformers", "vllm", "sglang")
ENGINE_WORDS = {"vllm": "vLLM", "sglang": "SGLang"}


class ProbeError(ValueError):
    """Input the probe cannot use: the message says what and why."""


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

    kwargs = (
        {"dtype": dtype}
        if int(transformers.__version__.split(".")[0]) >= 5
        else {"torch_dtype": dtype}
    )
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise ProbeError(
            f"--target {folder}: transformers cannot load it as a causal LM "
            f"({type(exc).__name__}: {str(exc).splitlines()[0]})"
        ) from None
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
            raise ProbeError(
                f"--device {device}: no CUDA device here (--device cpu runs it on the CPU)"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ProbeError(
                f"--device {device}: there are {torch.cuda.device_count()} CUDA devices here"
            )
    return dev


def _states_bytes(keep, max_tokens: int, hidden: int, itemsize: int) -> int:
    return len(keep) * max_tokens * (hidden or 0) * itemsize


def _transformers_target(
    target_dir: Path, dev, torch_dtype, tmodel, keep, dtype: str, max_tokens: int, plan: str, log
):
    """The target in transformers on one device, the plan logged first (refused with the
    numbers when it does not fit): a function of a prompt's tokens -> (states, greedy
    tokens, the target's embeddings)."""
    from eagle_capture.probe.target import decoder_layers, target_states

    weights = _weights_bytes(target_dir, torch_dtype)
    need = int(1.2 * weights) + _states_bytes(
        keep, max_tokens, tmodel.hidden_size, torch_dtype.itemsize
    )
    free = _available(dev)
    log(
        f"probe: {plan}; needs ~{_size(need)} on {dev} ({_size(weights)} of weights in "
        f"{dtype}), {_size(free)} free"
    )
    if need > free:
        raise ProbeError(
            f"the target needs ~{_size(need)} in {dtype} on {dev}, "
            f"{_size(free)} are free: a target this size does not fit one "
            f"device (the probe runs the whole target on one); use a machine with "
            f"more memory, --dtype bf16, or --engine vllm --tp N to run it in "
            f"vLLM's engine over N GPUs"
        )
    model = _load_target(target_dir, dev, torch_dtype)
    layers = decoder_layers(model, tmodel.num_layers)
    embed = model.get_input_embeddings()

    def run(tokens):
        ids = torch.tensor([tokens], device=dev)
        states, greedy = target_states(model, layers, ids, keep)
        return states, greedy, embed(ids)

    return run


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
    if engine in ENGINE_WORDS and engine_target is None:
        split = tp_problem(text_config, tp, ENGINE_WORDS[engine])
        if split:
            raise ProbeError(
                f"--tp {tp}: {split}: {ENGINE_WORDS[engine]} cannot serve the "
                f"target at tensor parallel {tp}"
            )
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
    plan = f"{len(cands)} readings over {len(prompt_list)} prompts (<= {max_tokens} tokens each)"
    owned = None
    try:
        if engine in ENGINE_WORDS:
            target_run, owned, measured = _engine_target(
                target_dir,
                tmodel,
                keep,
                tp,
                dtype,
                max_tokens,
                engine_args,
                engine_target,
                dev,
                dmodel,
                plan,
                log,
                engine,
                sglang_version,
            )
        else:
            target_run = _transformers_target(
                target_dir, dev, torch_dtype, tmodel, keep, dtype, max_tokens, plan, log
            )
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
        if engine in ENGINE_WORDS:
            notes += _engine_notes(owned or engine_target, measured)
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
        engines=(engine,) if engine in ENGINE_WORDS else ("sglang", "vllm"),
    )
    where = (
        f"{ENGINE_WORDS[engine]}'s engine at tensor parallel {measured['tp']}"
        if engine in ENGINE_WORDS
        else dev
    )
    log(f"probe: measured in {time.monotonic() - started:.1f} s in {where} ({dtype})")
    return report


def _engine_target(
    target_dir: Path,
    tmodel,
    keep,
    tp: int,
    dtype: str,
    max_tokens: int,
    engine_args,
    engine_target,
    dev,
    dmodel,
    plan: str,
    log,
    engine: str = "vllm",
    sglang_version: str = "",
):
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
    cache = (
        f"a KV cache of {_size(kv_cache_bytes(tmodel.num_layers, hidden, max_tokens))} per rank"
        if engine == "vllm"
        else f"a KV cache pool of {max_tokens + 1024} tokens (max_total_tokens)"
    )
    where = (
        "on its device, this process rank 0's on the host"
        if engine == "vllm"
        else "and copies them to the host; rank 0's pass through a side channel in "
        "/dev/shm (or the temporary directory) to this process"
    )
    log(
        f"probe: {plan}; the target in {words}'s engine at tensor parallel {tp}, dtype {dtype}: "
        f"{_size(on_disk)} of weights on disk (~{_size(on_disk // tp)} per rank, as {words} "
        f"loads them) and {cache} (one prompt at a time); per prompt each rank keeps "
        f"{len(keep)} states of <= {max_tokens} tokens x {hidden} ({_size(per_rank)}) "
        f"{where}, with the draft's inputs (~{_size(host)}); the draft "
        f"({_size(sum(p.numel() * p.element_size() for p in dmodel.parameters()))}) on {dev}"
    )
    if engine == "sglang":
        log(
            f"probe: SGLang {sglang_version} runs with the settings the capture needs: "
            f"{stated_settings(sglang_version)}; the first prompt includes the engine's "
            f"warm-up, the time for all prompts is estimated after the second"
        )
    owned = None
    if engine_target is None:
        t0 = time.monotonic()
        try:
            if engine == "vllm":
                engine_target = owned = VllmTarget(
                    target_dir,
                    tmodel.num_layers,
                    hidden,
                    keep,
                    tp=tp,
                    dtype=dtype,
                    max_tokens=max_tokens,
                    engine_args=engine_args,
                )
            else:
                engine_target = owned = SglangTarget(
                    target_dir,
                    tmodel.num_layers,
                    hidden,
                    keep,
                    tp=tp,
                    dtype=dtype,
                    max_tokens=max_tokens,
                    engine_args=engine_args,
                    version=sglang_version,
                )
        except EngineError as exc:
            raise ProbeError(str(exc)) from None
        log(
            f"probe: {words} served the target in {time.monotonic() - t0:.0f} s "
            f"({engine_target.tp} rank{'s' if engine_target.tp > 1 else ''}, "
            f"on {engine_target.device})"
        )
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

    measured = {
        "engine": engine,
        "tp": engine_target.tp,
        "dtype": dtype,
        "device": engine_target.device,
        "hidden_size": hidden,
    }
    if engine == "sglang":
        measured["sglang_version"] = sglang_version
    return run, owned, measured


def _engine_notes(target, measured: dict) -> list[str]:
    measured.update(
        ranks_checked=len(target.ranks),
        prompts=target.prompts,
        max_rank_difference=target.worst_rank_difference,
        engine_token_differs=target.engine_disagreements,
    )
    words = ENGINE_WORDS[measured["engine"]]
    notes = [
        f"measured in {words}'s engine at tensor parallel {target.tp}: every rank's "
        f"captured states are {measured['hidden_size']} wide (the full hidden size) and "
        f"equal to rank 0's (largest relative difference "
        f"{target.worst_rank_difference:.2g}) over {target.prompts} prompts"
    ]
    if getattr(target, "other_forwards", 0):
        measured["other_forwards"] = target.other_forwards
        notes.append(
            f"{words} ran {target.other_forwards} forwards of other tokens than the "
            f"prompts' (of its own, one token each on the lines seen): not scored"
        )
    if target.engine_disagreements:
        notes.append(
            f"{words}'s own sampled token differs from the probe's greedy token at the "
            f"last position in {target.engine_disagreements} of {target.prompts} "
            f"prompts (near-ties in the logits: computed over other rows)"
        )
    return notes


def _checkpoint_itemsize(folder: Path) -> int:
    """Bytes per element of the checkpoint's dtype (its config's), 2 when unsaid."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return 2
    name = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return 4 if "32" in name else 2


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
