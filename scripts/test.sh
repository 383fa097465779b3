#!/usr/bin/env bash
# The whole test suite: lint, protocol checks, generated-code freshness, then pytest (every tier).
#   scripts/test.sh            everything, as CI runs it
#   scripts/test.sh --fast     skip tests marked slow
#   scripts/test.sh -- ARGS    extra pytest arguments
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/venv.sh
MARK=()
PYTEST_ARGS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --fast) MARK=(-m "not slow") ;;
    --) shift; PYTEST_ARGS=("$@"); break ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
step() { printf '\n== %s\n' "$*"; }
step "ruff"
ruff check .
ruff format --check .
step "buf lint / format / breaking"
buf lint
buf format -d --exit-code
buf breaking --against protos/baseline.binpb
step "generated code is up to date"
python tools/gen_protos.py --check
step "protocol docs are up to date"
python tools/gen_docs.py --check
step "pytest"
python -m pytest "${MARK[@]}" "${PYTEST_ARGS[@]}"
