"""Smoke test of `bench/episodes.py --quick`: it runs end to end and prints its table.

No timing assertions: the figures depend on the machine and its load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc for CPU time"),
]


def test_quick_episode_bench_prints_a_row_per_level(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "episodes.py"), "--quick", "--json", str(out)],
        cwd=tmp_path,  # the bench must not depend on the working directory
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["concurrency", "episodes"])
    rows = [line.split() for line in lines[header + 1 :] if line.strip()]
    assert [row[0] for row in rows] == ["1", "8", "32"]
    for row in rows:
        assert len(row) == 11
        assert int(row[1]) >= 40
        assert float(row[2]) > 0
        assert float(row[5]) == 1.0
    levels = json.loads(out.read_text())["levels"]
    assert set(levels) == {"1", "8", "32"}
    for level in levels.values():
        median = level["median"]
        assert median["episodes_per_s"] > 0
        assert 0 < median["p50_ms"] <= median["p95_ms"]
        assert set(median["cpu_ms_per_episode"]) == {"agent", "model", "resources", "registry", "client"}
