#!/usr/bin/env bash
# Installs everything the test suite needs on a fresh Debian machine, then runs it.
# System packages: chromium (the browser tests drive Debian's build; nothing is downloaded at test time).
set -euo pipefail
cd "$(dirname "$0")/.."

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

if ! command -v chromium >/dev/null 2>&1; then
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium
fi

python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"   # the torch engine's CPU build
python3 -m pip install -q --disable-pip-version-check -e ".[test,gpu]"

exec python3 -m pytest -q -ra -p no:cacheprovider "$@"
