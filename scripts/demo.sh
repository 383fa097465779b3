#!/usr/bin/env bash
# The main job: launch a local stack on embedded defaults and collect rollouts through it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
source scripts/venv.sh
exec python -m gymrpc.cli demo "$@"
