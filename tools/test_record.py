"""Render the recorded test runs (pytest ``--record`` JSON) as the table the
README's reliability section cites.

    python tools/test_record.py docs/test_runs/*.json > docs/test_runs.md
"""

import argparse
import json
import sys
from pathlib import Path

OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


def cell(counts: dict) -> str:
    return ", ".join(f"{counts[o]} {o}" for o in OUTCOMES if counts.get(o)) or "-"


def render(records: list[tuple[str, dict]]) -> str:
    out = [
        "# Recorded test runs",
        "",
        "Made by `python tools/test_record.py docs/test_runs/*.json > docs/test_runs.md`",
        "from the JSON that `pytest --record FILE` writes (tests/conftest.py). One column a",
        "run; a file a run did not collect shows `-`.",
        "",
    ]
    for name, r in records:
        total = {}
        for counts in r["files"].values():
            for o, n in counts.items():
                total[o] = total.get(o, 0) + n
        out.append(
            f"- **{name}**: {r['date']}, {r['device']} ({r['gpus']} GPU(s), {r['cpus']} "
            f"CPUs), Python {r['python']}, torch {r['torch']}, Triton {r['triton']}: "
            f"{cell(total)} in {r['seconds']} s, exit status {r['exit_status']}"
        )
    out += [
        "",
        "| test file | " + " | ".join(name for name, _ in records) + " |",
        "|---|" + "---|" * len(records),
    ]
    for f in sorted({f for _, r in records for f in r["files"]}):
        out.append(
            f"| `{f}` | " + " | ".join(cell(r["files"].get(f, {})) for _, r in records) + " |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("records", nargs="+", help="JSON files written by pytest --record")
    args = p.parse_args(argv)
    records = [(Path(f).stem, json.loads(Path(f).read_text())) for f in args.records]
    sys.stdout.write(render(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
