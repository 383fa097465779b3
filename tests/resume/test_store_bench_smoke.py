"""Smoke test of `bench/store.py --quick`: every store, the harness baseline, the per-thread CPU split and
the several-process round run end to end and report sane figures. No timing assertions."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from gymrpc.store import fields
from tests.bench.quick import ROOT, run_quick

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread CPU clocks")


def test_quick_store_bench_reports_every_store_and_the_processes_round(tmp_path: Path) -> None:
    args = ["--total", "400", "--episodes", "16", "--procs", "2", "--dir", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    _, figures = run_quick("store.py", tmp_path, timeout=300, args=args, env=env)
    results = figures["results"]
    assert results["harness"]["cpu_us_per_boundary"] > 0
    for kind in ("log", "log-whole", "files"):
        assert results[kind]["boundaries_per_s"] > 0
        assert results[kind]["bytes_per_boundary"] > 100
    log = results["log"]
    assert log["bytes_per_boundary"] < results["log-whole"]["bytes_per_boundary"]  # deltas
    assert log["loop_cpu_us_per_boundary"] > 0
    assert log["lease_cpu_us_per_episode"] > 0
    disk = results["disk"]
    for way in ("append", "prezeroed"):
        assert disk[f"{way}_batches_per_s"] > 0
        assert disk[f"{way}_cpu_us_per_batch"] > 0
    processes = results["processes"]
    assert processes["procs"] == 2
    assert len(processes["per_process"]) == 2
    assert processes["boundaries_per_s"] > 0
    assert [r["steps"] for r in results["split"]] == [8, 64]
    if fields.NATIVE_BUILT:  # the C diff was built
        assert all(r["c_us"] > 0 for r in results["split"])
    history = results["history"]
    assert history["steps"] == 4
    assert history["record_bytes"] > 4 * 16_000  # the prompts' token ids are in the record
    assert history["message_us"] > 0
    assert history["encoded_us"] > 0
    saves = results["history_save"]
    if fields.NATIVE_BUILT:  # the per-field CRC is the C diff's
        assert saves["steps"] == 4
        assert saves["record_bytes"] > 4 * 16_000
        assert saves["per_field_us"] > 0
        assert saves["whole_us"] > 0
    else:
        assert saves is None
