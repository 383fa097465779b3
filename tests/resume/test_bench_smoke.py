"""Smoke test of `bench/resume.py --quick`: it runs end to end through real processes and reports sane figures.

No timing assertions: throughput depends on the machine, its disk and its load.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RATIO = re.compile(r"^RATIO agent/on / agent/off: ([0-9.]+)x episodes/s", re.MULTILINE)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc"),
]


def test_quick_resume_bench_reports_ratio_and_bytes_per_boundary(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    argv = [sys.executable, str(ROOT / "bench" / "resume.py"), "--quick", "--episodes", "40", "--concurrency", "16"]
    proc = subprocess.run(
        [*argv, "--json", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ratio = RATIO.search(proc.stdout)
    assert ratio is not None, proc.stdout
    assert float(ratio.group(1)) > 0
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"agent/off", "agent/on"}
    assert "store" not in results["agent/off"]
    store = results["agent/on"]["store"]
    assert store["failures"] == 0
    assert store["bytes_per_boundary"] > 100
    assert 4 <= store["boundaries_per_episode"] <= 12  # seed, model calls, tool calls, completion
    assert 0 < store["fsyncs_per_episode"] <= store["boundaries_per_episode"]  # saves share syncs
    assert len(store["round_cpu_ms_per_boundary"]) == 2  # one per timed round, paired with off's
    for r in results.values():
        assert r["episodes_per_s"] > 0
        assert r["stack_cpu_ms_per_episode"] > r["cpu_ms_per_episode"] > 0  # the shared servers work too
        shared = r["shared_cpu_ms_per_episode"]
        assert set(shared) == {"resources/counter", "model/policy", "client"}
        assert all(ms > 0 for ms in shared.values())
        assert abs(r["cpu_ms_per_episode"] + sum(shared.values()) - r["stack_cpu_ms_per_episode"]) < 1e-6
        assert len(r["rounds"]) == 2
        assert len(r["round_cpu_ms_per_episode"]) == 2
        assert all(ms > 0 for ms in r["round_cpu_ms_per_episode"])
        assert 0 < r["main_thread_cpu_ms_per_episode"] <= r["cpu_ms_per_episode"]  # the event loop's share
        assert 0 < r["machine_busy"] <= 1
