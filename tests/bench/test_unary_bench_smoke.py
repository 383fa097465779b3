"""Smoke test of `bench/unary_rpc.py --quick`: it runs end to end and reports positive numbers.

No timing assertions: the figures depend on the machine and its load.
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
RATIO = re.compile(r"^RATIO (\S+) / (\S+): ([0-9.]+)x calls/s \(([0-9]+) vs ([0-9]+)\)", re.MULTILINE)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and uses inotify"),
]


def test_quick_bench_reports_ratios(tmp_path: Path) -> None:
    for module in ("fastapi", "uvicorn", "httpx", "uvloop", "httptools"):
        pytest.importorskip(module)
    out = tmp_path / "bench.json"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    argv = [sys.executable, str(ROOT / "bench" / "unary_rpc.py"), "--quick", "--concurrency", "4"]
    proc = subprocess.run(
        [*argv, "--json", str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ratios = RATIO.findall(proc.stdout)
    pairs = {(config, base) for config, base, *_ in ratios}
    assert ("grpc-client", "http-async") in pairs, proc.stdout
    assert ("grpc-aio", "http-async") in pairs, proc.stdout
    assert ("grpc-aio-tls", "grpc-aio") in pairs, proc.stdout  # what TLS + mTLS costs
    assert ("grpc-aio-open", "grpc-aio") in pairs, proc.stdout  # what the data-plane credential costs
    for _, _, ratio, calls, base_calls in ratios:
        assert float(ratio) > 0
        assert int(calls) > 0
        assert int(base_calls) > 0
    results = json.loads(out.read_text())
    assert {"grpc-aio", "grpc-client", "http-async", "http-sync", "grpc-aio-c4"} <= set(results["configs"])
    for config in results["configs"].values():
        summary = config["summary"]
        assert summary["calls_per_s"] > 0
        assert 0 < summary["p50_us"] <= summary["p99_us"]
        assert summary["cpu_us_per_call"] >= 0
        assert len(config["rounds"]) == 2
