"""Smoke test of `bench/openai_front.py --quick`: it runs end to end and prints its ratios (no timing assertions)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_quick_bench_prints_ratios() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "openai_front.py"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    ratios = dict(re.findall(r"^RATIO (.+?): ([0-9.]+)x", proc.stdout, flags=re.MULTILINE))
    assert set(ratios) == {"raw / grpc", "httpx / grpc", "openai / grpc", "regenerate / replay"}
    assert all(float(v) > 0 for v in ratios.values())
