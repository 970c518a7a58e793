#!/usr/bin/env bash
# Build and check a release; uploads nothing. Steps (docs/setup.md, "Releasing"):
#   1. set __version__ in eagle_capture/__init__.py and add its section to CHANGELOG.md; commit;
#   2. bash scripts/release.sh   -> dist/ holds the sdist and the wheel, checked;
#   3. upload what it prints (twine upload dist/*), then tag: git tag vVERSION && git push --tags.
# Needs the package index once, for build and twine (in a throwaway venv, not the test Python).
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "release: $*" >&2; exit 1; }

VERSION=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' eagle_capture/__init__.py)
[ -n "$VERSION" ] || fail "no __version__ = \"...\" line in eagle_capture/__init__.py"
grep -q "^## $VERSION\b" CHANGELOG.md || fail "CHANGELOG.md has no '## $VERSION' section"
[ -z "$(git status --porcelain)" ] || fail "the working tree has changes not committed"
if git rev-parse -q --verify "refs/tags/v$VERSION" >/dev/null; then
    fail "v$VERSION is already tagged: set a new __version__ first"
fi

PY=$(bash scripts/setup_env.sh)
TOOLS=$(mktemp -d)
trap 'rm -rf "$TOOLS"' EXIT
echo "release: installing build and twine into a throwaway venv ..." >&2
python3 -m venv "$TOOLS/venv" >&2
"$TOOLS/venv/bin/python" -m pip install -q build twine >&2

rm -rf dist
"$TOOLS/venv/bin/python" -m build --outdir dist . >&2      # sdist, then the wheel built from it
"$TOOLS/venv/bin/python" -m twine check --strict dist/* >&2  # metadata and README render
# The wheel installed outside the checkout: every module, both plugins, the console script.
EAGLE_CAPTURE_DIST=dist $PY -m pytest -q -p no:cacheprovider tests/test_packaging.py tests/test_cli.py >&2

echo "release: eagle-capture $VERSION built and checked:" >&2
ls -l dist >&2
echo "release: next: twine upload dist/*  then  git tag v$VERSION && git push --tags" >&2
