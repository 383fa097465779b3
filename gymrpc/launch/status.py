"""`stack.json` as `gymrpc status` (and the demo) read and show it."""

from __future__ import annotations

import json
from pathlib import Path

from gymrpc import rundir, text


def read_state(run_dir: Path) -> dict | None:
    try:
        return json.loads((run_dir / rundir.STATE_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def format_table(
    run_dir: Path, state: dict | None, health: dict[str, str] | None = None, notes: dict[str, str] | None = None
) -> str:
    """The `gymrpc status` table; `notes` adds a NOTES column (for example a model's upstream mode)."""
    if not state:
        return f"no stack in {run_dir}"
    rows = [("NAME", "STATE", "HEALTH" if health is not None else "", "PID", "ADDRESS", "RESTARTS", "LAST EXIT")]
    for s in state["servers"]:
        rows.append(
            (
                s["name"],
                s["state"]
                + (f" (backoff {s['backoff_s']:g}s)" if s["state"] == "restarting" and s.get("backoff_s") else ""),
                (health or {}).get(s["name"], "") if health is not None else "",
                str(s["pid"] or "-"),
                s["address"] or "-",
                str(s["restarts"]),
                s["last_exit"] or "-",
            )
        )
    if notes:
        rows = [
            (*rows[0], "NOTES"),
            *((*r, notes.get(s["name"], "")) for r, s in zip(rows[1:], state["servers"], strict=True)),
        ]
    lines = [
        f"stack {state['state']} in {run_dir} (launcher pid {state['launcher_pid']}, registry {state['registry']})"
    ]
    lines += text.table(rows, indent="  ")
    return "\n".join(lines)
