"""Rewrite the output under each ``$ eagle-capture doctor ...`` or ``$ eagle-capture
probe ...`` line of the fenced blocks in README.md and docs/*.md (every file that has
such blocks; today the transcripts live in docs/doctor.md and docs/probe.md) with
what the command prints now on stdout (tests/test_examples.py and tests/test_probe.py
check they agree). Run from the repository root:
``python tools/update_readme_examples.py``."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"```\n(\$ eagle-capture (?:doctor|probe) [^\n]*)\n.*?```", re.S)


def rerun(match: re.Match) -> str:
    command = match.group(1)
    result = subprocess.run(
        [sys.executable, "-m", "eagle_capture.cli", *command.split()[2:]],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode == 2:
        raise SystemExit(f"{command}: {result.stderr}")
    return f"```\n{command}\n{result.stdout}```"


def main() -> int:
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        if not BLOCK.search(text):
            continue
        new = BLOCK.sub(rerun, text)
        path.write_text(new)
        print(
            f"{path.relative_to(ROOT)}: command blocks "
            + ("rewritten" if new != text else "unchanged")
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
