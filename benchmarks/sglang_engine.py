"""SGLang's real serving engine with EAGLE-3, the eagle-capture plugin off and on.

Run on a GPU machine with SGLang 0.5.13 and sglang-kernel 0.4.3 importable
(tools/gpu/gpu_sglang_engine.sh sets that up on the H200). Every engine is SGLang's own
offline ``sglang.Engine(...)`` with ``speculative_algorithm="EAGLE3"``; the plugin is
switched per process (``EAGLE_CAPTURE``; SGLang's ``load_plugins()`` runs it in the
scheduler process the engine spawns), so each configuration runs in a child process of
its own and this script gathers their JSON.

    python benchmarks/sglang_engine.py smoke --out DIR    # SGLang's norms vs torch
    python benchmarks/sglang_engine.py accept --out DIR   # tiny target + trained draft

``accept``: the suite's tiny Llama target (tests/data/tiny_eagle3) with its SpecForge draft,
the ids as exported ([1, 3, 5] in SpecForge's output convention; SGLang's Llama adds 1 and
captures layers [2, 4, 6], the layers the draft was trained on), one draft token per step,
greedy, the suite's 64 prompts cut to 16 tokens (as benchmarks/vllm_engine.py), 32 new
tokens each, all in one batch. Per mode: eager bf16 (``disable_cuda_graph``) and
SGLang's default bf16 (decode CUDA graphs and piecewise prefill graphs). It records
SGLang's own per-request counters (``spec_verify_ct``, ``spec_num_correct_drafts``,
``completion_tokens``), every generated token, and, from SGLang's own profiler over a
second generate, how often the plugin's Triton kernel ran inside the engine (0 with it off).

Attention runs on SGLang's Triton backend and sampling on its PyTorch sampler: SGLang's
default on Hopper, FlashAttention 3 from sglang-kernel, is a 1 GiB library the GPU bundle
does not carry (tools/gpu/make_sglang_engine_bundle.sh). The norms, rope and activation
are SGLang's own CUDA kernels (sglang-kernel and its nvcc-compiled jit_kernel).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared child runner
from vllm_engine import OUR_KERNEL, finish_wave, free_engine_memory, write_draft  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "tiny_eagle3"
# What each acceptance case writes into the SpecForge draft's config. SGLang reads only
# eagle_config's ids and its Llama adds 1 to each: as exported, the draft is fed right.
CASES = {"as_exported": {}}
# mode -> (dtype, eager): eager = no CUDA graphs of any kind. No float32: SGLang's CUDA
# RMSNorm (sgl_kernel) takes fp16 and bf16 only; 0.5.13's engine on an H100 stopped at its
# first forward in fp32 (2026-12-06).
MODES = {
    "eager_bf16": ("bfloat16", True),
    "graphs_bf16": ("bfloat16", False),
}
PROMPT_LEN, NEW_TOKENS, MAX_BATCH = 16, 32, 64  # tests/data/tiny_eagle3 has 64 prompts


# ---------------------------------------------------------------- in the child process


def _engine(target: str, draft: str, dtype: str, eager: bool):
    import sglang

    extra = (
        {"disable_cuda_graph": True, "disable_piecewise_cuda_graph": True}
        if eager
        else {"cuda_graph_max_bs": MAX_BATCH}
    )
    return sglang.Engine(
        model_path=target,
        skip_tokenizer_init=True,
        dtype=dtype,
        random_seed=0,
        speculative_algorithm="EAGLE3",
        speculative_draft_model_path=draft,
        speculative_num_steps=1,
        speculative_eagle_topk=1,
        speculative_num_draft_tokens=2,
        attention_backend="triton",
        sampling_backend="pytorch",
        context_length=256,
        max_running_requests=MAX_BATCH,
        max_total_tokens=8192,
        chunked_prefill_size=1024,
        # Engines share the GPU side by side: SGLang takes its static fraction of the memory
        # free when each starts, and max_total_tokens caps the KV pool well below it.
        mem_fraction_static=0.5,
        log_level="info",
        **extra,
    )


def _spec_counts(outs: list) -> dict:
    """SGLang's per-request counters summed (a request that never reached a verify step
    has none: its tokens count in completion_tokens only)."""
    metas = [o["meta_info"] for o in outs]
    spec = [m for m in metas if m.get("spec_verify_ct")]
    verify = sum(int(m["spec_verify_ct"]) for m in spec)
    return {
        "accepted": sum(int(m["spec_num_correct_drafts"]) for m in spec),
        "draft_tokens": sum(int(m["spec_num_proposed_drafts"]) for m in spec),
        "verify_steps": verify,
        "completion_tokens": sum(int(m.get("completion_tokens", 0)) for m in metas),
        "requests_without_verify": len(metas) - len(spec),
        # SGLang's accept length: tokens per verify step, the bonus token included
        "accept_length": round(sum(int(m["completion_tokens"]) for m in spec) / verify, 4)
        if verify
        else None,
    }


def _kernel_counts(engine, run, folder: Path) -> dict:
    """Run ``run()`` under SGLang's own profiler (it runs in the scheduler process, where
    the model is); count our capture kernel and all kernels in the trace it writes."""
    folder.mkdir(parents=True, exist_ok=True)
    engine.start_profile(
        output_dir=str(folder), activities=["GPU"], with_stack=False, record_shapes=False
    )
    run()
    engine.stop_profile()
    traces = sorted(glob.glob(str(folder / "*.trace.json.gz")))
    if not traces:
        return {"profile_error": f"no trace written in {folder}"}
    with gzip.open(traces[-1], "rt") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e.get("name", "") for e in events if e.get("cat") == "kernel"]
    ours = [name for name in kernels if OUR_KERNEL in name]
    return {
        "our_kernel_launches": len(ours),
        "gpu_kernels": len(kernels),
        "our_kernel_names": sorted(set(ours)),
    }


def child_accept(spec: dict) -> dict:
    work = Path(spec["work"])
    prompts = [
        json.loads(line)["token_ids"][:PROMPT_LEN]
        for line in (DATA / "prompts.jsonl").read_text().splitlines()
        if line.strip()
    ]
    prompts = prompts[:MAX_BATCH]
    params = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    result = {}
    for case in spec["cases"]:
        draft = write_draft(work / case / "draft", CASES[case])
        t0 = time.perf_counter()
        engine = _engine(str(DATA / "target"), str(draft), spec["dtype"], spec["eager"])
        r = {"engine_start_s": round(time.perf_counter() - t0, 1)}
        try:
            t0 = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            r["generate_s"] = round(time.perf_counter() - t0, 3)
            r.update(_spec_counts(outs))
            r["outputs"] = [list(o["output_ids"]) for o in outs]
            r["outputs_sha1"] = hashlib.sha1(json.dumps(r["outputs"]).encode()).hexdigest()[:12]
            # A second, profiled generate (4 prompts): does the plugin's kernel run in the engine?
            r.update(
                _kernel_counts(
                    engine,
                    lambda: engine.generate(input_ids=prompts[:4], sampling_params=params),
                    work / case / "profile",
                )
            )
        finally:
            engine.shutdown()
        result[case] = r
        print(
            f"ACCEPT {spec['label']} {case}: {r['accepted']} of {r['draft_tokens']} draft "
            f"tokens, accept length {r['accept_length']}, our kernel launched "
            f"{r.get('our_kernel_launches', 'n/a')} times",
            flush=True,
        )
        free_engine_memory()
    return result


def smoke() -> dict:
    """SGLang's own CUDA kernels on this GPU against torch, before any engine starts:
    sglang-kernel's RMSNorm (compiled), the jit_kernel fused add + RMSNorm (nvcc at first
    use), then the engine's import chain. Each stage records its error and the next runs."""
    import torch

    result: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    torch.manual_seed(0)
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    summed = (x.float() + r.float()).to(x.dtype)

    def err(out, v):
        v = v.float()
        ref = (v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w
        return (out.float() - ref.float()).abs().max().item()

    def sgl_kernel_norms():
        import sgl_kernel

        h, res = x.clone(), r.clone()
        sgl_kernel.fused_add_rmsnorm(h, res, w, 1e-6)
        return {
            "sgl_kernel": sgl_kernel.__version__,
            "sgl_kernel_rmsnorm_max_abs_err": err(sgl_kernel.rmsnorm(x, w, 1e-6), x),
            "sgl_kernel_fused_add_rmsnorm_residual_equal": bool(torch.equal(res, summed)),
            "sgl_kernel_fused_add_rmsnorm_max_abs_err": err(h, summed),
        }

    def jit_norm():
        from sglang.jit_kernel.norm import fused_add_rmsnorm

        h, res = x.clone(), r.clone()
        t0 = time.perf_counter()
        fused_add_rmsnorm(h, res, w, 1e-6)
        torch.cuda.synchronize()
        return {
            "jit_fused_add_rmsnorm_first_call_s": round(time.perf_counter() - t0, 1),
            "jit_fused_add_rmsnorm_residual_equal": bool(torch.equal(res, summed)),
            "jit_fused_add_rmsnorm_max_abs_err": err(h, summed),
        }

    def engine_imports():
        import sglang
        import sglang.srt.entrypoints.engine  # noqa: F401
        import sglang.srt.managers.scheduler  # noqa: F401
        import sglang.srt.speculative.eagle_worker_v2  # noqa: F401

        return {"sglang": sglang.__version__}

    for name, stage in (
        ("sgl_kernel", sgl_kernel_norms),
        ("jit_kernel", jit_norm),
        ("engine_imports", engine_imports),
    ):
        t0 = time.perf_counter()
        try:
            result.update(stage())
        except Exception as e:  # noqa: BLE001 - recorded: the point of a smoke test
            result[f"{name}_error"] = f"{type(e).__name__}: {e}"[:2000]
        result[f"{name}_s"] = round(time.perf_counter() - t0, 1)
    print("SMOKE", json.dumps(result), flush=True)
    return result


# ---------------------------------------------------------------- the parent: configurations


def _child_env(spec: dict) -> dict:
    env = dict(os.environ)
    env.update(
        EAGLE_CAPTURE="1" if spec["plugin"] == "on" else "0",
        PYTHONUNBUFFERED="1",
        # a problem the start-up id check finds is logged and kept in the log,
        # and the engine still serves (the case is counted either way)
        EAGLE_CAPTURE_ON_PROBLEM="install",
        # the plugin checks its capture against SGLang's own norm on the first
        # eager forwards and says so in the log (no cost after)
        EAGLE_CAPTURE_VERIFY="4" if spec["eager"] else "0",
    )
    return env


def _start(spec: dict) -> subprocess.Popen:
    work = Path(spec["work"])
    work.mkdir(parents=True, exist_ok=True)
    log = open(work / "child.log", "w")
    return subprocess.Popen(
        [sys.executable, __file__, "child", json.dumps(spec), str(work / "result.json")],
        env=_child_env(spec),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        start_new_session=True,
    )


def _end_groups(procs: list) -> None:
    """A child killed at the timeout leaves SGLang's scheduler and detokenizer processes
    behind (they hold GPU memory): end each child's whole process group."""
    for _, proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_accept(log, work: Path, modes: list, parallel: int, timeout: float) -> dict:
    specs = [
        {
            "label": f"accept_{mode}_{plugin}",
            "plugin": plugin,
            "dtype": MODES[mode][0],
            "eager": MODES[mode][1],
            "cases": list(CASES),
            "work": str(work / f"accept_{mode}_{plugin}"),
        }
        for mode in modes
        for plugin in ("off", "on")
    ]
    results: dict = {}
    for i in range(0, len(specs), parallel):
        wave = [(s, _start(s)) for s in specs[i : i + parallel]]
        try:
            results.update(finish_wave(wave, log, timeout))
        finally:
            _end_groups(wave)
    return results


def _modes(text: str) -> list:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(
            f"unknown mode(s) {unknown or text!r}: choose from {', '.join(MODES)}"
        )
    return modes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("accept", help="plugin off and on, SGLang's own acceptance counters")
    p.add_argument(
        "--out",
        required=True,
        type=Path,
        help="folder for the results (accept.json) and the children's log lines",
    )
    p.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/sglang_engine"),
        help="scratch folder (draft copies, caches, profiler traces)",
    )
    p.add_argument(
        "--modes",
        type=_modes,
        default=list(MODES),
        help=f"comma list of {', '.join(MODES)} (default: all)",
    )
    p.add_argument("--timeout", type=float, default=420, help="seconds per wave of children")
    p.add_argument("--parallel", type=int, default=6, help="children side by side")
    sub.add_parser(
        "smoke", help="SGLang's kernels vs torch, and the engine's imports"
    ).add_argument("--out", required=True, type=Path)
    child = sub.add_parser("child")
    child.add_argument("spec")
    child.add_argument("json")
    args = ap.parse_args(argv)
    if args.command == "child":
        spec = json.loads(args.spec)
        Path(args.json).write_text(json.dumps({"spec": spec, **child_accept(spec)}))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.command == "smoke":
        result = smoke()
        (args.out / "smoke.json").write_text(json.dumps(result))
        return 1 if any(key.endswith("_error") for key in result) else 0
    if args.parallel < 1:
        ap.error("--parallel must be at least 1")
    with open(args.out / "accept.log", "w") as log:
        results = run_accept(log, args.work, args.modes, args.parallel, args.timeout)
    (args.out / "accept.json").write_text(json.dumps(results))
    return 0 if all("error" not in r for r in results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
