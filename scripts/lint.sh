#!/usr/bin/env bash
# The contracts .ci/run checks before the suite (scripts/test.sh calls this; run it yourself before landing):
#   ruff on the whole tree, mypy on the product, and import-linter's contracts for the layering
#   docs/architecture.md states (engine imports neither gateway nor signaling, gateway not signaling,
#   configuration a leaf, no cycles). Settings in pyproject.toml. A few seconds warm, ~20 s cold.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

echo "lint: ruff" >&2
"$PY" -m ruff check --quiet .

# The product installs as one package from four folders (pyproject's [tool.setuptools.package-dir]),
# a mapping mypy and import-linter cannot follow: lay the package out as installed, in build/lint/
# (hard links where possible), check that, and name the files by their place in the repository.
tree=build/lint
rm -rf "$tree"
mkdir -p "$tree/voxgate"
cp -al voxgate/. "$tree/voxgate/" 2>/dev/null || cp -a voxgate/. "$tree/voxgate/"
for p in signaling gateway engine web; do
  cp -al "$p" "$tree/voxgate/$p" 2>/dev/null || cp -a "$p" "$tree/voxgate/$p"
done
find "$tree" -name __pycache__ -prune -exec rm -rf {} +
to_repo() { sed -E 's#(^|[^[:alnum:]_/])voxgate/(signaling|gateway|engine|web)/#\1\2/#g'; }

echo "lint: mypy" >&2
status=0
(cd "$tree" && "$PY" -m mypy --config-file ../../pyproject.toml --cache-dir ../../.mypy_cache -p voxgate) \
  > "$tree/mypy.out" 2>&1 || status=$?
if [ "$status" -ne 0 ]; then to_repo < "$tree/mypy.out" >&2; exit "$status"; fi

echo "lint: import contracts" >&2
(cd "$tree" && "$PY" -c 'import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())' \
  --no-logo --no-cache ../../pyproject.toml) > "$tree/imports.out" 2>&1 || status=$?
if [ "$status" -ne 0 ]; then to_repo < "$tree/imports.out" >&2; exit "$status"; fi
echo "lint: ok" >&2
