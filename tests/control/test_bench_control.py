"""Smoke test of `bench/control.py --quick`: it runs end to end and reports sane figures.

No timing assertions: the figures depend on the machine and its load.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_quick_control_bench_reports_figures(tmp_path: Path) -> None:
    out = tmp_path / "control.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "control.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert "prepare, per participant RPC: p50" in proc.stdout
    assert "reference (NeMo Gym)" in proc.stdout
    figures = json.loads(out.read_text())
    assert figures["episodes"] == 100
    assert 0 < figures["prepare_rpc_ms"]["p50"] <= figures["prepare_rpc_ms"]["p99"]
    staged = figures["prepare_staged_ms"]
    assert 0 < staged["p50"] <= staged["p99"] <= staged["max"]
    assert figures["commit_ms"]["median"] > 0
    assert figures["restore_ms"] > 0
    assert set(figures["bytes_per_episode_by_kind"]) == {"agent", "model", "resources"}
    assert all(v > 0 for v in figures["bytes_per_episode_by_kind"].values())
