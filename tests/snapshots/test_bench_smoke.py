"""Smoke test of `bench/snapshots.py`: it runs end to end and reports sane figures (no timing assertions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_quick_snapshot_bench_reports_ratios(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "snapshots.py"),
            "--quick",
            "--sessions",
            "20",
            "--repeat",
            "2",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("RATIO ") == 4
    results = json.loads(out.read_text())
    fresh = results["sessions"][0]["rows"]
    assert 300_000 < fresh["ref-json"][0] < 400_000  # the reference's ~345 KB per fresh session
    assert fresh["ours export"][0] < fresh["ref-json"][0] / 3
    checkpoint = results["checkpoints"][0]
    assert checkpoint["sessions"] == 20
    assert checkpoint["ours"]["bytes"] < checkpoint["ref_json"]["bytes"] / 5
    deltas = results["row_deltas"]
    assert deltas["sessions"] > 0
    assert deltas["own_bytes"] < deltas["whole_tables_bytes"], "a mutated session's bytes follow its changed rows"
