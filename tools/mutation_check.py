"""Break the code on purpose and check that the CPU test suite notices.

    python tools/mutation_check.py            # every mutant, CPU tests
    python tools/mutation_check.py --list     # the mutants
    python tools/mutation_check.py -k slot    # mutants whose name contains "slot"
    python tools/mutation_check.py --file eagle_capture/ops/   # mutants in those files
    python tools/mutation_check.py --check    # every anchor still matches (no tests run)
    python tools/mutation_check.py --json tools/mutation_runs/latest.json   # record the run

The mutants are data (tools/mutants.toml). Each is one exact text replacement
anchored by its file, the qualified name of the function, class or module-level
name it lies in (``FastLaunch.launch``, ``capture_op.declare``, ``NUM_BUFFERS``;
``<module>``: anywhere in the file) and its text, which must occur exactly once
inside that anchor: code that moves within its file keeps its mutants, and an
anchor that no longer matches is reported as an error (exit status 2) rather
than a mutant that "survives". The mutant is applied to a copy of the checkout
(the working tree is never touched); the copy's tests then run on CPU (kernels
under TRITON_INTERPRET=1). A mutant is *caught* when at least one test fails.
Exit status 1 if any mutant survives.
"""

import argparse
import ast
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport (scripts/setup_env.sh installs it)
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
MUTANTS_FILE = ROOT / "tools" / "mutants.toml"
MODULE = "<module>"


class Mutant(NamedTuple):
    name: str
    file: str  # relative to the checkout
    anchor: str  # qualified name of the def / class / module-level name, or <module>
    original: str
    mutated: str
    tests: list


class StaleMutant(Exception):
    """A mutant whose anchor or text no longer matches the code."""


def load_mutants(path: Path = MUTANTS_FILE) -> list[Mutant]:
    with open(path, "rb") as f:
        entries = tomllib.load(f).get("mutant", [])
    mutants = []
    for i, entry in enumerate(entries):
        try:
            mutants.append(
                Mutant(
                    entry["name"],
                    entry["file"],
                    entry["anchor"],
                    entry["original"],
                    entry["mutated"],
                    list(entry["tests"]),
                )
            )
        except KeyError as missing:
            raise SystemExit(
                f"{path}: mutant {i + 1} ({entry.get('name', '?')}) has no {missing}"
            ) from None
    return mutants


def _named_nodes(tree: ast.Module):
    """(qualified name, node) of every def and class (dotted through nesting) and
    of every module-level name bound by a plain or annotated assignment."""

    def walk(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{node.name}"
                yield name, node
                yield from walk(node.body, f"{name}.")
            elif not prefix and isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name):
                        yield target.id, node
            elif isinstance(node, (ast.If, ast.Try, ast.With)):  # guarded definitions
                for block in ("body", "orelse", "finalbody"):
                    yield from walk(getattr(node, block, []), prefix)
                for handler in getattr(node, "handlers", []):
                    yield from walk(handler.body, prefix)

    yield from walk(tree.body, "")


def anchor_span(text: str, anchor: str, rel: str = "") -> tuple[int, int]:
    """The character range of ``anchor`` in the source ``text`` (decorators
    included); StaleMutant when no def, class or module-level name has that
    qualified name, or more than one has."""
    if anchor == MODULE:
        return 0, len(text)
    nodes = [node for name, node in _named_nodes(ast.parse(text)) if name == anchor]
    if len(nodes) != 1:
        raise StaleMutant(f"{rel}: {len(nodes)} definitions named {anchor!r} (need exactly one)")
    node = nodes[0]
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts[first - 1], starts[node.end_lineno]


def locate(mutant: Mutant, root: Path = ROOT) -> tuple[str, int]:
    """(the file's text, the offset of the mutant's text in it); StaleMutant when
    the file, the anchor or exactly one occurrence of the text inside it is gone."""
    path = root / mutant.file
    if not path.is_file():
        raise StaleMutant(f"{mutant.file}: no such file")
    text = path.read_text()
    start, end = anchor_span(text, mutant.anchor, mutant.file)
    count = text.count(mutant.original, start, end)
    if count != 1:
        raise StaleMutant(
            f"{mutant.file}: the original text occurs {count} times in "
            f"{mutant.anchor} (need exactly once)"
        )
    return text, text.index(mutant.original, start, end)


def mutated_text(mutant: Mutant, root: Path = ROOT) -> str:
    text, at = locate(mutant, root)
    return text[:at] + mutant.mutated + text[at + len(mutant.original) :]


def stale_mutants(mutants, root: Path = ROOT) -> list[tuple[str, str]]:
    """(name, why) of every mutant that no longer matches, or whose tests are gone."""
    stale = []
    for m in mutants:
        try:
            locate(m, root)
            if m.original == m.mutated:
                raise StaleMutant("the mutated text equals the original")
            missing = [t for t in m.tests if not (root / t.split("::")[0]).exists()]
            if missing:
                raise StaleMutant(f"no such test file: {' '.join(missing)}")
        except StaleMutant as why:
            stale.append((m.name, str(why)))
    names = [m.name for m in mutants]
    stale += [
        (n, "the name is used twice") for n in sorted({n for n in names if names.count(n) > 1})
    ]
    return stale


def _copy_checkout(dest: Path) -> None:
    ignore = shutil.ignore_patterns(
        ".git",
        ".venv",
        ".cache",
        "__pycache__",
        "*.egg-info",
        ".pytest_cache",
        ".hypothesis",
        "out",
    )
    shutil.copytree(ROOT, dest, ignore=ignore, symlinks=True)
    # The real-SGLang overlays are large and read-only: share them.
    if (ROOT / ".cache").exists():
        os.symlink(ROOT / ".cache", dest / ".cache")


def run_mutant(mutant: Mutant, python) -> tuple[bool, str]:
    with tempfile.TemporaryDirectory(prefix="mutant-", ignore_cleanup_errors=True) as tmp:
        copy = Path(tmp) / "checkout"
        _copy_checkout(copy)
        (copy / mutant.file).write_text(mutated_text(mutant, copy))
        env = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
        env.pop("TRITON_INTERPRET", None)  # tests/conftest.py sets it on CPU
        result = subprocess.run(
            [python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *mutant.tests],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
        )
        last = (result.stdout.strip().splitlines() or ["(no output)"])[-1]
        return result.returncode != 0, last


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--list", action="store_true")
    p.add_argument(
        "--check",
        action="store_true",
        help="only check that every mutant's anchor and text still match",
    )
    p.add_argument(
        "-k",
        action="append",
        default=[],
        help="only mutants whose name contains this (repeatable: any of them)",
    )
    p.add_argument(
        "--file",
        action="append",
        default=[],
        help="only mutants in files under this path (repeatable: any of them)",
    )
    p.add_argument("--json", help="write the run (date, each mutant's outcome and seconds) here")
    p.add_argument("--mutants", type=Path, default=MUTANTS_FILE, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    mutants = [
        m
        for m in load_mutants(args.mutants)
        if (not args.k or any(k in m.name for k in args.k))
        and (not args.file or any(m.file.startswith(f) for f in args.file))
    ]
    if args.list:
        for m in mutants:
            print(f"{m.name:48s} {m.file}::{m.anchor:36s} {' '.join(m.tests)}")
        return 0
    stale = stale_mutants(mutants)
    for name, why in stale:
        print(f"STALE    {name}: {why}", file=sys.stderr)
    if stale:
        print(
            f"{len(stale)} mutant(s) no longer match the code: re-anchor them in "
            f"{args.mutants.relative_to(ROOT) if args.mutants.is_relative_to(ROOT) else args.mutants}",
            file=sys.stderr,
        )
        return 2
    if args.check:
        print(f"{len(mutants)} mutants, every anchor matches")
        return 0
    survived, results, started = 0, [], time.monotonic()
    for m in mutants:
        t0 = time.monotonic()
        caught, detail = run_mutant(m, sys.executable)
        survived += not caught
        results.append(
            {
                "name": m.name,
                "file": m.file,
                "anchor": m.anchor,
                "tests": m.tests,
                "caught": caught,
                "detail": detail,
                "seconds": round(time.monotonic() - t0, 1),
            }
        )
        print(f"{'caught  ' if caught else 'SURVIVED'} {m.name:48s} {detail}", flush=True)
    total = time.monotonic() - started
    print(f"{len(mutants) - survived} of {len(mutants)} mutants caught in {total / 60:.1f} min")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps(
                {
                    "date": datetime.date.today().isoformat(),
                    "filter": args.k + args.file,
                    "mutants": len(mutants),
                    "caught": len(mutants) - survived,
                    "minutes": round(total / 60, 1),
                    "cpus": os.cpu_count(),
                    "results": results,
                },
                indent=1,
            )
            + "\n"
        )
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
