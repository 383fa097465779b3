"""Smoke test of `bench/control.py --quick`: it runs end to end and reports sane figures.

No timing assertions: the figures depend on the machine and its load.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.quick import run_quick

pytestmark = pytest.mark.slow


def test_quick_control_bench_reports_figures(tmp_path: Path) -> None:
    stdout, figures = run_quick("control.py", tmp_path, timeout=300)
    assert "prepare, per participant RPC: p50" in stdout
    assert "reference (NeMo Gym)" in stdout
    assert figures["episodes"] == 100
    assert 0 < figures["prepare_rpc_ms"]["p50"] <= figures["prepare_rpc_ms"]["p99"]
    staged = figures["prepare_staged_ms"]
    assert 0 < staged["p50"] <= staged["p99"] <= staged["max"]
    for mode in ("stop", "nonstop", "nonstop-messages"):  # parked, then published: never the other way round
        commit = figures["commit_ms"][mode]
        assert commit["n"] == 2
        assert commit["parked_median"] > 0
        assert 0 < commit["publish_median"] <= commit["publish_max"]
    assert "commit, non-stop" in stdout
    assert "commit to publish median" in stdout
    for mode in ("nonstop", "nonstop-messages"):
        assert 0 < figures["capture_ms_summed"][mode]["median"] <= figures["capture_ms_summed"][mode]["max"]
    assert "packed scope over one EpisodeId message per episode" in stdout
    assert figures["restore_ms"] > 0
    assert set(figures["bytes_per_episode_by_kind"]) == {"agent", "model", "resources"}
    assert all(v > 0 for v in figures["bytes_per_episode_by_kind"].values())
    increments = figures["incremental"]  # 10 of 100 episodes moved: it writes less than a full commit
    assert increments["changed"] == 10
    assert 0 < increments["incremental"]["bytes"] < increments["full"]["bytes"]
    assert "incremental commit after 10 of 100 episodes changed" in stdout
