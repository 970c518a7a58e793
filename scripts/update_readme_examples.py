"""Rewrite the output under each ``$ eagle-capture doctor ...`` line of the README's
fenced blocks with what the doctor prints now (tests/test_examples.py checks they
agree). Run from the repository root: ``python scripts/update_readme_examples.py``."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    path = ROOT / "README.md"
    text = path.read_text()

    def rerun(match: re.Match) -> str:
        command = match.group(1)
        result = subprocess.run([sys.executable, "-m", "eagle_capture.layer_ids.doctor",
                                 *command.split()[3:]], cwd=ROOT, capture_output=True,
                                text=True, timeout=120)
        if result.returncode == 2:
            raise SystemExit(f"{command}: {result.stderr}")
        return f"```\n{command}\n{result.stdout}```"

    new = re.sub(r"```\n(\$ eagle-capture doctor [^\n]*)\n.*?```", rerun, text, flags=re.S)
    path.write_text(new)
    print("README.md: doctor blocks " + ("rewritten" if new != text else "unchanged"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
