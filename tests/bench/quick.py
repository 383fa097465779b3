"""Run a `bench/` script with `--quick --json` in its own process: the shared half of the bench
smoke tests (each then checks its own figures; no timing assertions anywhere)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def without_pythonpath() -> dict[str, str]:
    """This environment minus PYTHONPATH: a bench must find the repository by itself."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def run_quick(
    script: str,
    folder: Path,
    *,
    timeout: float,
    args: Sequence[str] = (),
    cwd: Path = ROOT,
    env: Mapping[str, str] | None = None,
) -> tuple[str, dict[str, Any]]:
    """`bench/<script> --quick --json <folder>/<stem>.json [args]` run in `cwd` with `env` (None:
    this one); its stdout and the figures it wrote. A non-zero exit fails with its output."""
    out = folder / f"{Path(script).stem}.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick", "--json", str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=None if env is None else dict(env),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())
