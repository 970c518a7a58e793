"""The probe with its target in SGLang's own engine (``--engine sglang``): SGLang's
``Engine`` serving the tiny trained target of tests/data/tiny_eagle3 on CPU (SGLang's CPU
engine, ``SGLANG_USE_CPU_ENGINE=1``, torch-native attention; the GPU-only packages
stubbed in every SGLang process by tests/sglang_real/engine_site/sitecustomize.py); run
in a child process by tests/test_probe_sglang.py:

    python -m tests.sglang_real.probe_engine --work DIR --json OUT --tp 1
    SGLANG_CPU_OMP_THREADS_BIND='0|1' python -m tests.sglang_real.probe_engine ... --tp 2

At TP 1 the command line first, as a user runs it (the probe starts and stops its own
engine); then one engine start for the rest: every capture layer hooked, plus two test
hooks (SGLang's ``forward_hooks`` too):

* :func:`own_capture` on the text model (``model``): SGLang's own EAGLE-3 capture, turned
  on after the first forward by setting the model's ``layers_to_capture`` (what
  ``set_eagle3_layers_to_capture`` sets); the hook keeps the model's aux list -- the
  states SGLang's own capture loop hands the draft -- and returns the hidden states
  alone, as the model returns them with capture off. The probe's states must equal it
  bit for bit, on every rank (rank 0: the states; others: their digests);
* :func:`skip_allreduce` on layer 3's MLP ``down_proj`` (``RowParallelLinear``): once the
  side channel holds a file ``skip``, it sets the projection's ``reduce_results`` to False
  on every rank -- SGLang then skips that all-reduce, and the stream from layer 4 on is
  each rank's partial sum (TP 2), which the probe must refuse. SGLang <= 0.5.20's Llama
  MLP reduces itself; 0.5.22+ sums in the layer's stage boundary (not switched here).

The probe then runs on it for each case (``run_probe(engine_target=...)``); the JSON has
each case's report (``ProbeReport.to_json``), the comparisons and the refusal.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data" / "tiny_eagle3"
OWN_LAYERS = [1, 2, 3, 4, 5, 6, 7]  # SGLang's Llama loop cannot capture layer 0 (<= 0.5.20)
PARTIAL_LAYER = 3
PROMPTS = {1: 24, 2: 12}


def own_capture(config):
    """Test hook factory (text model): SGLang's own capture of OWN_LAYERS, kept per forward
    in ``config["dir"]`` as ``own.<rank>.<n>.pt``."""
    from eagle_capture.integrations.sglang.probe_hooks import _tp

    count = [0]

    def hook(module, args, output):
        count[0] += 1
        if not module.layers_to_capture:
            module.layers_to_capture = list(OWN_LAYERS)
            return None
        hidden, aux = output
        rank, _ = _tp()
        path = os.path.join(config["dir"], f"own.{rank}.{count[0]:06d}.pt")
        torch.save({"input_ids": args[0].cpu(), "aux": [a.cpu() for a in aux]}, path + ".tmp")
        os.replace(path + ".tmp", path)
        return hidden

    return hook


def skip_allreduce(config):
    def hook(module, args, output):
        if os.path.exists(os.path.join(config["dir"], "skip")):
            module.reduce_results = False

    return hook


def test_hooks(directory: str) -> list:
    return [
        {
            "name": "test_own_capture",
            "target_modules": ["model"],
            "hook_factory": "tests.sglang_real.probe_engine:own_capture",
            "config": {"dir": directory},
        },
        {
            "name": "test_skip_allreduce",
            "target_modules": [f"model.layers.{PARTIAL_LAYER}.mlp.down_proj"],
            "hook_factory": "tests.sglang_real.probe_engine:skip_allreduce",
            "config": {"dir": directory},
        },
    ]


def cases(work: Path) -> dict:
    from tests.vllm_real.probe_engine import cases as vllm_cases

    return vllm_cases(work)


def prompts(work: Path, tp: int) -> Path:
    lines = (DATA / "prompts.jsonl").read_text().splitlines()[: PROMPTS[tp]]
    path = work / f"prompts_tp{tp}.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


# SGLang on the CPU: its CPU engine's device, torch-native attention, and a static memory
# fraction of the host's memory (the default is computed from what is free at start, on a
# shared CI machine sometimes below what the weights already hold: SGLang refuses then).
# On a GPU (tests/test_probe_sglang_gpu.py): SGLang's Triton attention (the engine bundle
# carries no FlashInfer), a modest static fraction beside the transformers reference.
SERVERS = {
    "cpu": {"device": "cpu", "attention_backend": "torch_native", "mem_fraction_static": 0.9},
    "cuda": {"attention_backend": "triton", "mem_fraction_static": 0.3},
}


def engine_args(device: str) -> list:
    return [a for key, value in SERVERS[device].items() for a in ("--engine-arg", f"{key}={value}")]


def command_line(work: Path, tp: int, extra=(), device="cpu", dtype="fp32") -> dict:
    """``eagle-capture probe --engine sglang`` as a user runs it (its own engine, started and
    shut down by the probe): exit status, stdout, stderr, the --json record."""
    from tests.probe_cli import run_cli

    return run_cli(
        [
            "--engine",
            "sglang",
            "--tp",
            str(tp),
            "--target",
            str(DATA / "target"),
            "--draft",
            str(DATA / "draft_specforge"),
            "--prompts",
            str(prompts(work, tp)),
            "--dtype",
            dtype,
            "--max-tokens",
            "64",
            "--device",
            device,
            *engine_args(device),
            *extra,
        ],
        work / "cli.json",
    )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--work", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--cli-only", action="store_true", help="the command line alone")
    p.add_argument("--device", choices=sorted(SERVERS), default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)

    from eagle_capture.probe.engine import EngineError
    from eagle_capture.probe.probe import ProbeError, run_probe
    from eagle_capture.probe.sglang_engine import SglangTarget, _side_channel

    out = {}
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    if args.tp == 1:
        out["cli"] = command_line(work, 1, device=args.device, dtype=args.dtype)
    if args.cli_only:
        with open(args.json, "w") as f:
            json.dump(out, f)
        os._exit(0)
    calibration = prompts(work, args.tp)
    # The test hooks write to a directory of their own, given before the engine starts.
    test_dir = _side_channel()
    target = SglangTarget(
        DATA / "target",
        8,
        64,
        range(9),
        tp=args.tp,
        dtype=args.dtype,
        max_tokens=64,
        engine_args=dict(SERVERS[args.device]),
        extra_hooks=test_hooks(test_dir),
    )
    out["ranks"] = target.ranks
    out["version"] = target.version
    own_dir = Path(test_dir)
    try:
        out["own"] = compare_own(target, calibration, own_dir)
        names = ["specforge", "speculators", "converted"] if args.tp == 1 else ["specforge"]
        if args.device == "cuda":
            names.append("mla")  # SGLang serves MLA drafts from 0.5.13 (the GPU bundle's line)
        for name, draft in cases(work).items():
            if name not in names:
                continue
            report = run_probe(
                str(DATA / "target"),
                str(draft),
                str(calibration),
                device=args.device,
                dtype=args.dtype,
                max_tokens=64,
                engine_target=target,
                log=log,
                progress=False,
            )
            out[name] = report.to_json()
            print(f"PROBE_SGLANG {name} tp {args.tp}: {report.verdict}", flush=True)
        if args.tp > 1:
            (own_dir / "skip").write_text("")
            try:
                run_probe(
                    str(DATA / "target"),
                    str(DATA / "draft_specforge"),
                    str(calibration),
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
    finally:
        target.close()
        import shutil

        shutil.rmtree(test_dir, ignore_errors=True)
    with open(args.json, "w") as f:
        json.dump(out, f)
    sys.stdout.flush()
    os._exit(0)


def compare_own(target, calibration: Path, own_dir: Path) -> dict:
    """The probe's states against SGLang's own capture of the same forwards (read from
    ``own_dir``), bit for bit, on every rank: every prompt after the first (SGLang's own
    capture is on from the model's second forward), the first too when SGLang ran a
    forward before it."""
    from eagle_capture.integrations.vllm.probe_capture import digest

    lines = [json.loads(line) for line in calibration.read_text().splitlines() if line]
    compared, layers = 0, set()
    for i, p in enumerate(lines[:6]):
        tokens = p["token_ids"][:64]
        states, _, _ = target.run(tokens)
        seen = 0
        for a in target.answers:
            # This prompt's forward: SGLang may run forwards of its own before the first
            # prompt (0.5.20 at TP 2 does), which turn the own capture on earlier.
            own = sorted(own_dir.glob(f"own.{a['rank']}.*.pt"))
            recs = [torch.load(path) for path in own]
            for path in own:
                path.unlink()
            recs = [r for r in recs if torch.equal(r["input_ids"], torch.tensor(tokens))]
            if not recs:
                assert i == 0, f"rank {a['rank']}: no own capture of prompt {i}"
                continue
            assert len(recs) == 1, f"rank {a['rank']}: {len(recs)} own captures of prompt {i}"
            for k, c in enumerate(OWN_LAYERS):
                if a["rank"] == 0:
                    assert torch.equal(states[c][0], recs[0]["aux"][k]), (
                        f"capture layer {c}: the probe's state differs from SGLang's own"
                    )
                assert torch.equal(a["digest"][c], digest(recs[0]["aux"][k])), (
                    f"rank {a['rank']} capture layer {c}: digest differs from SGLang's own"
                )
                layers.add(c)
            seen += 1
        assert seen in (0, len(target.answers)), f"prompt {i}: own captures on {seen} ranks"
        compared += bool(seen)
    return {
        "forwards_compared": compared,
        "layers": sorted(layers),
        "ranks": [a["rank"] for a in target.answers],
    }


if __name__ == "__main__":
    main()
