#!/usr/bin/env bash
# Refresh constraints.txt: exact pins of everything kvgate and all its extras install,
# resolved afresh in a throw-away virtual environment (nothing from the machine's Python).
# CI (PIP_CONSTRAINT) and the image install from it; `pip install .` keeps pyproject's lower
# bounds. Run it after changing a dependency in pyproject.toml, with the image's Python:
#   tools/lock.sh                      (PYTHON=python3.11 tools/lock.sh to pick one)
set -euo pipefail
cd "$(dirname "$0")/.."
venv="$(mktemp -d)"
trap 'rm -rf "$venv"' EXIT
"${PYTHON:-python3}" -m venv "$venv"
py="$venv/bin/python"
extras="$("$py" -c 'import tomllib
print(",".join(sorted(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"])))')"
# An empty PIP_CONSTRAINT: resolve from pyproject alone, not from the file being replaced.
PIP_CONSTRAINT="" "$py" -m pip install --quiet --no-cache-dir ".[$extras]"
{
  echo "# Exact pins for CI and the image, made by tools/lock.sh (do not edit by hand):"
  echo "# Python $("$py" -c 'import platform; print(platform.python_version())'), kvgate with extras $extras."
  "$py" -m pip freeze --exclude kvgate | LC_ALL=C sort -f
} > constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) pins"
