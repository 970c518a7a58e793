"""``eagle-capture probe``: the probe's command line (its arguments, the checks made
before anything is loaded, the printed report). The measurement is
:func:`eagle_capture.probe.probe.run_probe`; what it does and its exit status:
:mod:`eagle_capture.probe.probe`."""

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

import torch

from eagle_capture.layer_ids.deployment import wrap
from eagle_capture.layer_ids.trainers import CONVENTIONS
from eagle_capture.probe.engine import FIXED_ARGS
from eagle_capture.probe.probe import (
    DTYPES,
    ENGINE_WORDS,
    ENGINES,
    ProbeError,
    json_problem,
    run_probe,
)
from eagle_capture.probe.readings import SGLANG_DEFAULT

__all__ = ["build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    """Bad options: one line on stderr and exit 2 (not the usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def _engine_arg(text: str) -> tuple[str, object]:
    """``KEY=VALUE`` for vLLM's ``LLM(...)`` or SGLang's ``Engine(...)``: the value as JSON
    when it parses, else text."""
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not KEY=VALUE (e.g. gpu_memory_utilization=0.85)"
        )
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="eagle-capture probe",
        description="Measure which target layers an EAGLE-3 draft was trained on: its first "
        "step's agreement with the target for every reading of its ids.",
    )
    p.add_argument("--target", required=True, help="the target model's folder (HF format)")
    p.add_argument("--draft", required=True, help="the EAGLE-3 draft's folder")
    p.add_argument(
        "--prompts",
        help='calibration prompts: .jsonl of {"text"} or '
        '{"token_ids"}, or a text file (one prompt per '
        "paragraph); default: the package's own",
    )
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="transformers",
        help="where the target runs: transformers on one device (default), or "
        "vLLM's or SGLang's engine as it serves the target (--tp, its dtype, "
        "quantisation); an engine's run answers for that engine's lines",
    )
    p.add_argument(
        "--tp",
        type=int,
        default=1,
        help="--engine vllm|sglang: the tensor-parallel size the target is served with",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        type=_engine_arg,
        default=[],
        metavar="KEY=VALUE",
        help="--engine vllm|sglang: another argument of vLLM's LLM(...) or "
        "SGLang's Engine(...) (repeatable; e.g. quantization=fp8, "
        "trust_remote_code=true)",
    )
    p.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the target (transformers) and the draft run: cpu, cuda, cuda:N",
    )
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES) + ["auto"],
        default=None,
        help="default: with --engine vllm|sglang auto (the checkpoint's, as the "
        "engine serves it); else bf16 on cuda, fp32 on cpu",
    )
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per prompt (default 512)")
    p.add_argument(
        "--id-convention",
        choices=CONVENTIONS,
        default="auto",
        help="how the config's ids are read (default: from the trainer's markers)",
    )
    p.add_argument(
        "--sglang-version",
        default=None,
        help=f"the SGLang version whose capture is shown (default {SGLANG_DEFAULT}; "
        f"with --engine sglang the installed one)",
    )
    p.add_argument(
        "--json",
        metavar="FILE",
        help="also write the table, the verdict and each engine's line here",
    )
    p.add_argument(
        "--min-margin",
        type=float,
        default=0.03,
        help="the agreement margin (fraction) that decides (default 0.03)",
    )
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    bad = (
        "--max-tokens must be >= 3"
        if args.max_tokens < 3
        else "--min-margin must be in [0, 1)"
        if not 0 <= args.min_margin < 1
        else "--tp and --engine-arg need --engine vllm or sglang"
        if args.engine not in ENGINE_WORDS and (args.tp != 1 or args.engine_arg)
        else ""
    )
    if args.engine == "sglang":
        from eagle_capture.probe.sglang_engine import fixed_arg

        fixed = [f"{key} ({fixed_arg(key)})" for key in dict(args.engine_arg) if fixed_arg(key)]
    else:
        fixed = [
            f"{key} ({why})" for key, why in FIXED_ARGS.items() if key in dict(args.engine_arg)
        ]
    if fixed and not bad:
        bad = f"--engine-arg {', '.join(fixed)}: set by the probe"
    if bad:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    unwritable = json_problem(args.json) if args.json else None
    if unwritable:
        print(f"error: --json {args.json}: {unwritable}", file=sys.stderr)
        return 2
    dtype = args.dtype or (
        "auto"
        if args.engine in ENGINE_WORDS
        else "bf16"
        if args.device.startswith("cuda")
        else "fp32"
    )
    try:
        report = run_probe(
            args.target,
            args.draft,
            args.prompts,
            args.device,
            dtype,
            args.max_tokens,
            args.id_convention,
            args.min_margin,
            log=lambda s: print(s, file=sys.stderr),
            sglang_version=args.sglang_version,
            engine=args.engine,
            tp=args.tp,
            engine_args=dict(args.engine_arg),
        )
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


if __name__ == "__main__":
    sys.exit(main())
