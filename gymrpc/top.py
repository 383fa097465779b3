"""`gymrpc top`: a live view of a running stack, one row per server, from the servers' own metrics.

Names, states and restarts come from the launcher's `stack.json`; where each server serves its
metrics comes from its registry entry (label `metrics`; the registry's own from `registry.ready`).
Rates and the p95 are taken between two scrapes one interval apart, so the first frame already
shows what the stack does now, not averages since it started. Needs a stack started with
`metrics: true`; servers without metrics show `-`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from gymrpc import rundir, text
from gymrpc.registry import RegistryClient

SCRAPE_TIMEOUT = 2.0
MAX_SCRAPE_BYTES = 8 << 20
"""A metrics page larger than this is cut off and its server shown as unreadable."""


@dataclass
class Sample:
    """What one scrape of one server says, reduced to what `top` shows."""

    calls: float = 0.0
    buckets: dict[float, float] = field(default_factory=dict)
    """Cumulative RPC latency histogram over all methods: upper bound -> count."""
    episodes_inflight: float = 0.0
    episodes_finished: float = 0.0
    episodes_resumed: float = 0.0
    last_commit: float = 0.0
    phase: str = ""
    store_saves: float | None = None
    """Records an agent's durable episode store (`resume_dir`) made durable; None: no such store."""
    store_batches: float = 0.0


def parse_metrics(text: str) -> Sample:
    sample = Sample()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "gymrpc_rpc_calls_total":
                sample.calls += s.value
            elif s.name == "gymrpc_rpc_duration_seconds_bucket":
                bound = float(s.labels["le"])
                sample.buckets[bound] = sample.buckets.get(bound, 0.0) + s.value
            elif s.name == "gymrpc_episodes_inflight":
                sample.episodes_inflight += s.value
            elif s.name == "gymrpc_episodes_finished_total":
                sample.episodes_finished += s.value
            elif s.name == "gymrpc_episodes_resumed_total":
                sample.episodes_resumed += s.value
            elif s.name == "gymrpc_checkpoint_last_commit_timestamp_seconds":
                sample.last_commit = max(sample.last_commit, s.value)
            elif s.name == "gymrpc_checkpoint_phase" and s.value == 1:
                sample.phase = s.labels["phase"]
            elif s.name == "gymrpc_store_records_written_total":
                sample.store_saves = (sample.store_saves or 0.0) + s.value
            elif s.name == "gymrpc_store_group_commits_total":
                sample.store_batches += s.value
    return sample


def p95(before: Mapping[float, float], after: Mapping[float, float]) -> float | None:
    """The 95th percentile latency of the calls between two cumulative histograms (bucket upper bound)."""
    deltas = sorted((bound, after[bound] - before.get(bound, 0.0)) for bound in after)
    total = deltas[-1][1] if deltas else 0.0
    if total <= 0:
        return None
    for bound, count in deltas:
        if count >= 0.95 * total:
            return bound
    return None


@dataclass
class Row:
    name: str
    state: str
    restarts: int
    address: str
    metrics_url: str | None
    before: Sample | None = None
    after: Sample | None = None


async def _scrape(client: httpx.AsyncClient, url: str | None) -> Sample | None:
    if url is None:
        return None
    try:
        async with client.stream("GET", url, timeout=SCRAPE_TIMEOUT) as response:
            if response.status_code != 200:
                return None
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_SCRAPE_BYTES:
                    return None
        return parse_metrics(body.decode("utf-8", "replace"))
    except (httpx.HTTPError, ValueError):
        return None


async def _metrics_urls(run_dir: Path, registry: str) -> dict[tuple[str, str], str]:
    """(name, address) -> metrics URL, from the registry's entries and its own ready file."""
    urls: dict[tuple[str, str], str] = {}
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError, KeyError):
        ready = json.loads(rundir.registry_ready(run_dir).read_text())
        if ready.get("metrics"):
            urls[(ready["name"], ready["address"])] = ready["metrics"]
    with contextlib.suppress(Exception):  # a gone registry leaves only what stack.json knows
        async with RegistryClient(registry, timeout=SCRAPE_TIMEOUT) as client:
            for endpoint in await client.list():
                if url := endpoint.labels.get("metrics"):
                    urls[(endpoint.name, endpoint.address)] = url
    return urls


async def snapshot(run_dir: Path, interval: float) -> tuple[dict, list[Row], float]:
    """Read the stack, scrape every server twice `interval` apart; returns (state, rows, seconds between)."""
    state = json.loads((run_dir / rundir.STATE_FILE).read_text())
    urls = await _metrics_urls(run_dir, state["registry"])
    rows = []
    for s in state["servers"]:
        base = s["name"].split("#")[0]
        url = urls.get((base, s["address"] or "")) or urls.get((s["name"], s["address"] or ""))
        rows.append(Row(s["name"], s["state"], s["restarts"], s["address"] or "-", url))
    async with httpx.AsyncClient() as client:
        first = time.monotonic()
        before = await asyncio.gather(*(_scrape(client, r.metrics_url) for r in rows))
        await asyncio.sleep(interval)
        after = await asyncio.gather(*(_scrape(client, r.metrics_url) for r in rows))
        elapsed = time.monotonic() - first
    for row, b, a in zip(rows, before, after, strict=True):
        row.before, row.after = b, a
    return state, rows, elapsed


def render(run_dir: Path, state: Mapping, rows: list[Row], elapsed: float, now: float | None = None) -> str:
    now = time.time() if now is None else now
    header = ("NAME", "STATE", "RESTARTS", "EPISODES", "FINISHED", "RESUMED", "CALLS/S", "P95", "CHECKPOINT", "ADDRESS")
    table = [header]
    for row in rows:
        a, b = row.after, row.before
        if a is None:
            cells = ["-"] * 6
        else:
            rate = (a.calls - b.calls) / elapsed if b is not None and elapsed > 0 else None
            latency = p95(b.buckets if b else {}, a.buckets)
            checkpoint = a.phase or "-"
            if a.last_commit:
                checkpoint += f", committed {max(0.0, now - a.last_commit):.0f}s ago"
            elif a.store_saves is not None:
                checkpoint = _durable(b, a, elapsed)
            cells = [
                f"{a.episodes_inflight:.0f}",
                f"{a.episodes_finished:.0f}",
                f"{a.episodes_resumed:.0f}",
                "-" if rate is None else f"{rate:.1f}",
                "-" if latency is None else _duration(latency),
                checkpoint,
            ]
        table.append((row.name, row.state, str(row.restarts), *cells, row.address))
    lines = [f"stack {state['state']} in {run_dir} ({len(rows)} servers, launcher {state['launcher']})"]
    lines += text.table(table)
    return "\n".join(lines)


def _durable(before: Sample | None, after: Sample, elapsed: float) -> str:
    """An agent's own durable store (it is no checkpoint participant): its saves per second, and per sync."""
    if before is None or before.store_saves is None or after.store_saves is None or elapsed <= 0:
        return "durable"
    saves, batches = after.store_saves - before.store_saves, after.store_batches - before.store_batches
    per_sync = f", {saves / batches:.1f} per sync" if batches > 0 else ""
    return f"durable, {saves / elapsed:.0f} saves/s{per_sync}"


def _duration(seconds: float) -> str:
    return f"<={seconds * 1000:.1f}ms" if seconds < 1 else f"<={seconds:.1f}s"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--once", action="store_true", help="print one frame and exit (for scripts)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between frames (default %(default)s)")


def run(args: argparse.Namespace, run_dir: Path) -> int:
    if args.interval <= 0:
        print("gymrpc top: --interval must be positive", file=sys.stderr)
        return 2
    if not (run_dir / rundir.STATE_FILE).exists():
        print(f"no stack in {run_dir}", file=sys.stderr)
        return 3
    try:
        while True:
            state, rows, elapsed = asyncio.run(snapshot(run_dir, args.interval))
            frame = render(run_dir, state, rows, elapsed)
            if args.once:
                print(frame)
                return 0
            sys.stdout.write("\x1b[H\x1b[2J" + frame + "\n")
            sys.stdout.flush()
    except KeyboardInterrupt:
        return 0
