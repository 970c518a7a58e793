"""How long ``eagle-capture`` takes to answer, measured as a user meets it: a new
interpreter per run, wall-clock from start to exit.

    python benchmarks/cli_startup.py [--runs N] [--python PATH]

Prints the median and the best of N runs for ``--help``, ``doctor --help`` and the doctor
on the Llama example, and, for scale, for importing torch and Triton (what every command
paid before the package loaded its ops lazily). ``--python`` times another interpreter,
e.g. a venv with only the package installed (no torch).
"""

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# (label, arguments after the interpreter, the exit status and output that mean it ran)
CASES = [
    ("eagle-capture --help", ["-m", "eagle_capture", "--help"], 0, b"usage"),
    ("eagle-capture doctor --help", ["-m", "eagle_capture", "doctor", "--help"], 0, b"usage"),
    # 1: the example's draft is fed wrongly on vLLM (the README's excerpt)
    (
        "eagle-capture doctor (Llama example)",
        [
            "-m",
            "eagle_capture",
            "doctor",
            "--draft-config",
            str(EXAMPLES / "llama3_70b_specforge_draft_config.json"),
            "--target-config",
            str(EXAMPLES / "llama3_70b_target_config.json"),
        ],
        1,
        b"verdict",
    ),
    ("import torch, triton (for scale)", ["-c", "import torch, triton"], 0, b""),
]


def time_runs(argv: list[str], runs: int, expected: tuple[int, bytes]) -> list[float] | None:
    """Seconds per run, or None when the command fails (torch not installed, say)."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        # From / so that the checkout is not on sys.path: the installed package is timed.
        result = subprocess.run(argv, cwd="/", capture_output=True)
        times.append(time.perf_counter() - start)
        if result.returncode != expected[0] or expected[1] not in result.stdout:
            return None
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per command (default 5)")
    parser.add_argument(
        "--python", default=sys.executable, help="the interpreter to time (default: this one)"
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    print(f"{args.python}, {args.runs} runs each, wall-clock seconds per run (new interpreter):")
    for label, command, code, output in CASES:
        times = time_runs([args.python, *command], args.runs, (code, output))
        if times is None:
            print(f"  {label:40s} failed (not installed in this interpreter?)")
        else:
            print(f"  {label:40s} median {statistics.median(times):6.3f}   best {min(times):6.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
