"""Run a `bench/` script with `--quick --json` in its own process: the shared half of the bench
smoke tests (each then checks its own figures; no timing assertions anywhere)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_quick(script: str, folder: Path, *, timeout: float) -> tuple[str, dict[str, Any]]:
    """`bench/<script> --quick --json <folder>/<stem>.json`; its stdout and the figures it wrote."""
    out = folder / f"{Path(script).stem}.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, json.loads(out.read_text())
