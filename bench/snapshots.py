"""Workplace session snapshots: gymrpc's Arrow codec and shared blocks against the reference's JSON.

    .venv/bin/python bench/snapshots.py            # 1,000-session checkpoint, 3 rounds, about 80 s
    .venv/bin/python bench/snapshots.py --quick    # 100 sessions, 1 round, a few seconds (the smoke test)
    .venv/bin/python bench/snapshots.py --json out.json

Baselines, re-implemented from the reference's description (reference §3.1) and measured in
the same run on the same sessions:

- `ref-json`: NeMo Gym's `_encode_frame` export, `{container: {attribute: {"index": [...],
  "columns": [{"name", "dtype", "values", "nan"}]}}}` as JSON (about 345 KB per fresh
  session), decoded back into frames the way its `_decode_frame` does.
- `to_json`: `DataFrame.to_json(orient="table")` per table (what the issue names); it cannot
  encode the repeated index labels a created calendar event leaves, so mutated sessions that
  created one are counted as failures.

Ours: `cold` encodes every table (`encode_session`, no cache); `export` is what a session
actually does (`Session.export`: tables it never changed reuse the seed blocks encoded once per
process); `checkpoint` is one many-session checkpoint with each distinct block stored once
(`gymrpc.snapshots.collect`), restored with `restore_sessions`. Sessions in the checkpoint make
0-3 random state-changing calls each (seeded, with values of their own, so no two sessions'
changed tables are alike); `--touch-all` also runs the worst case for sharing, where every
session changes every table it can.

The goal figure (issue #6) is the checkpoint's `RATIO ... encode`: the reference's JSON of every
session's full state against our `export_tables` of every session plus `collect`, for the same
1,000 live sessions (built first, untimed, as a server holds them). The two sides' encodes take
turns in chunks of 50 sessions, so load from other jobs on a shared machine hits both alike;
each round re-encodes every changed table, and the medians of `--rounds` are reported, in wall
and CPU seconds. The per-session `RATIO fresh` / `RATIO mutated` lines are the single-session
figures (one session's export, every repeat re-encoding its changed tables).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gymrpc.envkit import TaskSpec
from gymrpc.envs.workplace_assistant import WorkplaceEnvironment, WorkplaceSession
from gymrpc.envs.workplace_assistant._data import seed_blocks, seed_frames
from gymrpc.snapshots import (
    SessionTables,
    collect,
    decode_session,
    encode_session,
    encode_table,
    pack,
    restore_sessions,
    unpack,
)
from gymrpc.snapshots.rowdelta import changed_rows

ENV = WorkplaceEnvironment()


def mutations(n: int) -> list[tuple[str, dict[str, Any]]]:
    """State-changing calls as the example tasks make them; `n` makes each session's changes its own."""
    return [
        ("email_send_email", {"recipient": "kofi.mensah@atlas.com", "subject": f"Plan {n}", "body": "See you Monday."}),
        ("email_delete_email", {"email_id": f"{n % 500:08d}"}),
        (
            "calendar_create_event",
            {
                "event_name": f"Sync {n}",
                "participant_email": "raj.patel@atlas.com",
                "event_start": "2023-12-04 10:00:00",
                "duration": "30",
            },
        ),
        ("calendar_update_event", {"event_id": "00000252", "field": "event_name", "new_value": f"Forum {n}"}),
        (
            "analytics_create_plot",
            {
                "time_min": f"2023-11-{n % 30 + 1:02d}",
                "time_max": "2023-11-30",
                "value_to_plot": "total_visits",
                "plot_type": "bar",
            },
        ),
        ("project_management_update_task", {"task_id": "00000149", "field": "task_name", "new_value": f"Task {n}"}),
        (
            "customer_relationship_manager_add_customer",
            {"customer_name": f"Ada {n}", "assigned_to_email": "raj.patel@atlas.com", "status": "Lead"},
        ),
        (
            "customer_relationship_manager_update_customer",
            {"customer_id": "00000095", "field": "notes", "new_value": f"Call {n}"},
        ),
    ]


def row_deltas(count: int, seed: int) -> dict[str, Any]:
    """A mix of sessions, each replaying 1-3 of the calls above with values of its own: its own bytes
    (blocks it does not share with the seed) against the codec's size of only its changed and added
    rows, and against today's whole changed tables."""
    rng = random.Random(seed)
    seeds = {digest for digest, _ in seed_blocks().values()}
    ratios, own_total, rows_total, whole_total = [], 0, 0, 0
    for n in range(count):
        calls = rng.sample(mutations(n + 1), rng.randrange(1, 4))
        session = new_session(calls)
        exported = session.export_tables()
        own = sum(len(data) for digest, data in exported.blocks.items() if digest not in seeds)
        rows = whole = 0
        for name in session.tables:
            if session.tables.version(name) == 0:
                continue
            frame, base = session.tables.get(name), seed_frames()[name]
            whole += len(encode_table(frame))
            if base.index.is_unique and frame.index.is_unique:
                rows += len(encode_table(frame.iloc[changed_rows(base, frame)]))
            else:
                rows += len(encode_table(frame))  # no row identity: the whole table is its change
        if not rows:
            continue
        ratios.append(own / rows)
        own_total, rows_total, whole_total = own_total + own, rows_total + rows, whole_total + whole
    return {
        "sessions": len(ratios),
        "own_bytes": own_total,
        "changed_rows_bytes": rows_total,
        "whole_tables_bytes": whole_total,
        "median_ratio": statistics.median(ratios),
        "max_ratio": max(ratios),
    }


# -- the reference's JSON export (re-implemented from its description) ---------------------------


def ref_encode(tables: dict[str, pd.DataFrame]) -> bytes:
    state: dict[str, dict[str, Any]] = {}
    for name, frame in tables.items():
        container, attribute = name.split(".", 1)
        columns = []
        for label, series in frame.items():
            values = series.tolist()
            nan = [i for i, v in enumerate(values) if isinstance(v, float) and v != v]
            for i in nan:
                values[i] = None
            columns.append({"name": label, "dtype": str(series.dtype), "values": values, "nan": nan})
        state.setdefault(container, {})[attribute] = {"index": frame.index.tolist(), "columns": columns}
    return json.dumps(state).encode()


def ref_decode(payload: bytes) -> dict[str, pd.DataFrame]:
    tables = {}
    for container, attributes in json.loads(payload).items():
        for attribute, doc in attributes.items():
            labels = doc["index"]
            index = pd.RangeIndex(len(labels)) if labels == list(range(len(labels))) else pd.Index(labels)
            data = {}
            for column in doc["columns"]:
                values = column["values"]
                for i in column["nan"]:
                    values[i] = np.nan
                data[column["name"]] = pd.Series(values, dtype=object, index=index).astype(column["dtype"])
            tables[f"{container}.{attribute}"] = pd.DataFrame(data, index=index)
    return tables


def to_json_encode(tables: dict[str, pd.DataFrame]) -> bytes:
    return json.dumps({name: frame.to_json(orient="table") for name, frame in tables.items()}).encode()


def to_json_decode(payload: bytes) -> dict[str, pd.DataFrame]:
    from io import StringIO

    return {name: pd.read_json(StringIO(text), orient="table") for name, text in json.loads(payload).items()}


# -- sessions --------------------------------------------------------------------------------------


def new_session(calls: list[tuple[str, dict[str, Any]]]) -> WorkplaceSession:
    session = ENV.seed(TaskSpec("bench", [], {"ground_truth": []}))[0]
    for name, arguments in calls:
        session.call_tool(name, arguments)
    return session


def timed(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Median seconds of `repeat` runs, and the last result."""
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def one_session(label: str, calls: list[tuple[str, dict[str, Any]]], repeat: int) -> dict[str, Any]:
    session = new_session(calls)
    tables = session.tables.frames()
    rows: dict[str, Any] = {}
    enc, data = timed(lambda: ref_encode(tables), repeat)
    dec, _ = timed(lambda: ref_decode(data), repeat)
    rows["ref-json"] = (len(data), enc, dec)
    try:
        enc, data = timed(lambda: to_json_encode(tables), repeat)
        dec, _ = timed(lambda: to_json_decode(data), repeat)
        rows["to_json"] = (len(data), enc, dec)
    except ValueError as exc:
        rows["to_json"] = f"fails: {exc}"
    meta = session.meta()
    enc, data = timed(lambda: pack(encode_session(tables, meta)), repeat)
    dec, _ = timed(lambda: _decode_payload(data), repeat)
    rows["ours cold"] = (len(data), enc, dec)

    changed = [name for name in session.tables if session.tables.version(name) > 0]

    def export() -> bytes:
        for name in changed:  # drop the cached block, so every run is the first export after the changes
            session.tables.set(name, session.tables.get(name))
        return session.export()

    enc, data = timed(export, repeat)
    dec, _ = timed(lambda: ENV.restore(data), repeat)
    rows["ours export"] = (len(data), enc, dec)
    return {"label": label, "rows": rows}


def _decode_payload(data: bytes) -> dict[str, pd.DataFrame]:
    exported = unpack(data)
    return decode_session(exported.manifest, exported.blocks.__getitem__)


class Clock:
    """Wall and CPU seconds summed over every stretch timed `with` it (CPU time is steadier on a shared machine)."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def __enter__(self) -> Clock:
        self._started = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *_: object) -> None:
        self.wall += time.perf_counter() - self._started[0]
        self.cpu += time.process_time() - self._started[1]


CHUNK = 50
"""Sessions per turn when the two sides' encodes alternate (see `checkpoint_round`)."""


def checkpoint_round(sessions: dict[str, WorkplaceSession], first: str) -> dict[str, Any]:
    """Each side checkpoints every live session once: full state for the reference, `export_tables`
    plus `collect` for ours; then each side decodes its whole checkpoint.

    The encodes take turns by chunks of `CHUNK` sessions (who goes first alternates), so a change in
    the machine's load hits both sides alike, and neither works in caches it just warmed for itself.
    """
    for session in sessions.values():  # untimed: drop the blocks of changed tables, as if they just changed
        for name in session.tables:
            if session.tables.version(name) > 0:
                session.tables.set(name, session.tables.get(name))
    clocks = {(side, phase): Clock() for side in ("ref", "ours") for phase in ("encode", "decode")}
    payloads: list[bytes] = []
    exports: dict[str, SessionTables] = {}
    items = list(sessions.items())
    turns = ["ref", "ours"] if first == "ref" else ["ours", "ref"]
    for at in range(0, len(items), CHUNK):
        chunk = items[at : at + CHUNK]
        for side in turns:
            with clocks[side, "encode"]:
                if side == "ref":
                    payloads.extend(ref_encode(session.tables.frames()) for _, session in chunk)
                else:
                    exports.update((sid, session.export_tables()) for sid, session in chunk)
        turns.reverse()
    with clocks["ours", "encode"]:
        bundle = collect(exports)
    for side in (first, "ours" if first == "ref" else "ref"):
        with clocks[side, "decode"]:
            if side == "ref":
                for payload in payloads:
                    ref_decode(payload)
            else:
                restored = restore_sessions(
                    bundle.manifests,
                    bundle.blocks.__getitem__,
                    lambda _sid, e, t: ENV.build_session(e, t),
                    ENV.known_frames(),
                )
    assert len(restored) == len(sessions)
    manifest_bytes, block_bytes = bundle.size()
    return {
        "first": first,
        "distinct_blocks": len(bundle.blocks),
        "ref": {"bytes": sum(map(len, payloads)), **{p: clocks["ref", p] for p in ("encode", "decode")}},
        "ours": {
            "bytes": manifest_bytes + block_bytes,
            "manifest_bytes": manifest_bytes,
            "block_bytes": block_bytes,
            **{p: clocks["ours", p] for p in ("encode", "decode")},
        },
    }


def checkpoint(count: int, touch_all: bool, seed: int, rounds: int) -> dict[str, Any]:
    """Both sides checkpoint the same `count` live sessions, `rounds` times; medians are reported.

    All sessions are built first (untimed), as a server holds them, so each side encodes them in
    one pass the way a checkpoint does, rather than each session right after it was built.
    """
    rng = random.Random(seed)
    sessions = {
        f"s{i}": new_session(mutations(i) if touch_all else rng.sample(mutations(i), rng.randrange(4)))
        for i in range(count)
    }
    runs = [checkpoint_round(sessions, "ref" if round_ % 2 == 0 else "ours") for round_ in range(rounds)]
    for session in sessions.values():
        session.close()

    def median(side: str, phase: str, clock: str) -> float:
        return statistics.median(getattr(run[side][phase], clock) for run in runs)

    result: dict[str, Any] = {"sessions": count, "touch_all": touch_all, "rounds": rounds}
    result["distinct_blocks"] = runs[0]["distinct_blocks"]
    for side, key in (("ref", "ref_json"), ("ours", "ours")):
        figures = {k: v for k, v in runs[0][side].items() if k not in ("encode", "decode")}
        for phase in ("encode", "decode"):
            figures[f"{phase}_s"] = median(side, phase, "wall")
            figures[f"{phase}_cpu_s"] = median(side, phase, "cpu")
        result[key] = figures
    result["per_round"] = [
        {
            "first": run["first"],
            **{
                f"{side}_{phase}_{clock}": getattr(run[side][phase], clock)
                for side in ("ref", "ours")
                for phase in ("encode", "decode")
                for clock in ("wall", "cpu")
            },
        }
        for run in runs
    ]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="100 sessions, fewer repeats")
    parser.add_argument("--sessions", type=int, help="sessions in the checkpoint (default 1000, 100 with --quick)")
    parser.add_argument("--repeat", type=int, help="timed repeats per single-session figure (default 15, 5 quick)")
    parser.add_argument("--rounds", type=int, help="checkpoint rounds, medians reported (default 3, 1 with --quick)")
    parser.add_argument(
        "--touch-all", action="store_true", help="also run a checkpoint where every session changes every table"
    )
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args()
    count = args.sessions or (100 if args.quick else 1000)
    repeat = args.repeat or (5 if args.quick else 15)
    rounds = args.rounds or (1 if args.quick else 3)
    results: dict[str, Any] = {"pandas": pd.__version__, "sessions": []}
    for label, calls in (("fresh session", []), ("mutated session", mutations(0))):
        result = one_session(label, calls, repeat)
        results["sessions"].append(result)
        print(f"\n{label} (median of {repeat})")
        print(f"  {'codec':12s} {'bytes':>10s} {'encode ms':>10s} {'decode ms':>10s}")
        for codec, row in result["rows"].items():
            if isinstance(row, str):
                print(f"  {codec:12s} {row[:70]}")
            else:
                print(f"  {codec:12s} {row[0]:10d} {row[1] * 1e3:10.2f} {row[2] * 1e3:10.2f}")
        ref, ours, cold = result["rows"]["ref-json"], result["rows"]["ours export"], result["rows"]["ours cold"]
        ratios = f"bytes: {ref[0] / ours[0]:.1f}x  encode: {ref[1] / ours[1]:.1f}x  decode: {ref[2] / ours[2]:.1f}x"
        print(f"RATIO {label.split()[0]} {ratios}  (cold, every table encoded: encode {ref[1] / cold[1]:.1f}x)")
    deltas = row_deltas(40 if args.quick else 200, seed=11)
    results["row_deltas"] = deltas
    print(
        f"\nrow deltas: {deltas['sessions']} mutated sessions (1-3 calls each): own bytes {deltas['own_bytes']} B, "
        f"their changed and added rows alone {deltas['changed_rows_bytes']} B, whole changed tables "
        f"{deltas['whole_tables_bytes']} B"
    )
    print(
        f"RATIO mutated own bytes / changed rows: median {deltas['median_ratio']:.2f}x, max {deltas['max_ratio']:.2f}x "
        f"(target <= 2x); whole tables / own bytes {deltas['whole_tables_bytes'] / deltas['own_bytes']:.1f}x"
    )
    runs = [False, True] if args.touch_all else [False]
    results["checkpoints"] = []
    for touch_all in runs:
        c = checkpoint(count, touch_all, seed=7, rounds=rounds)
        results["checkpoints"].append(c)
        ref, ours = c["ref_json"], c["ours"]
        kind = "every session changed every table" if touch_all else "0-3 random changes per session"
        print(f"\ncheckpoint of {count} live sessions ({kind}); {c['distinct_blocks']} distinct blocks")
        for i, r in enumerate(c["per_round"], 1):
            ratio = {
                f"{phase}_{clock}": r[f"ref_{phase}_{clock}"] / r[f"ours_{phase}_{clock}"]
                for phase in ("encode", "decode")
                for clock in ("wall", "cpu")
            }
            print(
                f"  round {i} ({r['first']} first): encode ref {r['ref_encode_wall']:.2f} s,"
                f" ours {r['ours_encode_wall']:.2f} s = {ratio['encode_wall']:.1f}x (cpu {ratio['encode_cpu']:.1f}x);"
                f"  decode ref {r['ref_decode_wall']:.2f} s, ours {r['ours_decode_wall']:.2f} s"
                f" = {ratio['decode_wall']:.1f}x (cpu {ratio['decode_cpu']:.1f}x)"
            )
        print(f"  median of {rounds}: wall (cpu) seconds")
        print(
            f"  ref-json  {ref['bytes']:12d} B  encode {ref['encode_s']:.2f} ({ref['encode_cpu_s']:.2f}) s"
            f"  decode {ref['decode_s']:.2f} ({ref['decode_cpu_s']:.2f}) s"
        )
        print(
            f"  ours      {ours['bytes']:12d} B  encode {ours['encode_s']:.2f} ({ours['encode_cpu_s']:.2f}) s"
            f"  decode {ours['decode_s']:.2f} ({ours['decode_cpu_s']:.2f}) s"
            f"  (manifests {ours['manifest_bytes']} B, blocks {ours['block_bytes']} B)"
        )
        name = f"checkpoint{'-touch-all' if touch_all else ''}"
        print(
            f"RATIO {name} bytes: {ref['bytes'] / ours['bytes']:.1f}x  "
            f"encode: {ref['encode_s'] / ours['encode_s']:.1f}x  decode: {ref['decode_s'] / ours['decode_s']:.1f}x"
            f"  (cpu: encode {ref['encode_cpu_s'] / ours['encode_cpu_s']:.1f}x,"
            f" decode {ref['decode_cpu_s'] / ours['decode_cpu_s']:.1f}x)"
        )
    c = results["checkpoints"][0]
    ref, ours = c["ref_json"], c["ours"]
    print(
        f"\nGOAL ({count}-session checkpoint, issue #6): bytes {ref['bytes'] / ours['bytes']:.1f}x (target >= 10x),"
        f" encode {ref['encode_s'] / ours['encode_s']:.1f}x wall, {ref['encode_cpu_s'] / ours['encode_cpu_s']:.1f}x cpu"
        " (target >= 5x)"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
