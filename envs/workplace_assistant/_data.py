"""The bundled tables and tool schemas, loaded once per process.

Tables are read as the reference reads them (every CSV cell a string, an empty cell a float
NaN; `user_engaged` converted to bool; an empty `_plots_data`), but with `dtype=object`
spelled out: under pandas 3 `dtype=str` would give the new string dtype, which turns a
stored None into NaN and refuses non-string values, unlike the reference's pandas 2 tables.
Each session gets deep copies (cheap: the str objects are shared, not the arrays), so
sessions running in different threads never share a pandas block. The seed tables'
encoded blocks are computed once and reused by every untouched session's snapshot.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from gymrpc.envkit import ToolSpec
from gymrpc.snapshots import Block, TableSet, digest_of, encode_table

DATA_DIR = Path(__file__).parent / "data"
TOOLKITS = (
    "company_directory",
    "email",
    "calendar",
    "analytics",
    "project_management",
    "customer_relationship_manager",
)
_CSV = {
    "company_directory._emails": "email_addresses.csv",
    "email._emails": "emails.csv",
    "calendar._calendar_events": "calendar_events.csv",
    "analytics._analytics_data": "analytics_data.csv",
    "project_management._project_tasks": "project_tasks.csv",
    "customer_relationship_manager._crm_data": "customer_relationship_manager_data.csv",
}
TABLE_NAMES = (
    "company_directory._emails",
    "email._emails",
    "calendar._calendar_events",
    "analytics._analytics_data",
    "analytics._plots_data",
    "project_management._project_tasks",
    "customer_relationship_manager._crm_data",
)
COMPARED_TABLES = (
    "calendar._calendar_events",
    "email._emails",
    "analytics._plots_data",
    "project_management._project_tasks",
    "customer_relationship_manager._crm_data",
)
"""The five tables the reward compares, in the reference's order."""

_lock = threading.Lock()
_seed: dict[str, pd.DataFrame] = {}
_seed_blocks: dict[str, Block] = {}


def _load() -> dict[str, pd.DataFrame]:
    frames: dict[str, pd.DataFrame] = {}
    for name, file in _CSV.items():
        path = DATA_DIR / "csv" / file
        if name == "company_directory._emails":
            frames[name] = pd.read_csv(path, header=None, names=["email_address"], dtype=object)
        else:
            frames[name] = pd.read_csv(path, dtype=object)
    analytics = frames["analytics._analytics_data"]
    analytics["user_engaged"] = analytics["user_engaged"] == "True"
    frames["analytics._plots_data"] = pd.DataFrame(columns=["file_path"], dtype=object)
    return {name: frames[name] for name in TABLE_NAMES}


def seed_frames() -> Mapping[str, pd.DataFrame]:
    """The pristine tables of this process (shared: never modify them; copy first)."""
    with _lock:
        if not _seed:
            _seed.update(_load())
        return _seed


def seed_blocks() -> Mapping[str, Block]:
    """The encoded block of every pristine table, computed once."""
    frames = seed_frames()
    with _lock:
        if not _seed_blocks:
            for name, frame in frames.items():
                data = encode_table(frame)
                _seed_blocks[name] = (digest_of(data), data)
        return _seed_blocks


def seed_frames_by_digest() -> dict[str, pd.DataFrame]:
    """Seed frames keyed by their block's digest: restores copy these instead of decoding the block.

    Exact because decoding a block gives back the very frame it encodes (tested on these tables).
    """
    frames = seed_frames()
    return {digest: frames[name] for name, (digest, _) in seed_blocks().items()}


def fresh_tables(*, with_blocks: bool = True) -> TableSet:
    """A new session's tables: deep copies of the seed, with the seed blocks as their snapshot cache."""
    frames = {name: frame.copy(deep=True) for name, frame in seed_frames().items()}
    return TableSet(frames, seed_blocks() if with_blocks else None)


def table_columns() -> dict[str, frozenset[object]]:
    """The column labels of every table (no tool adds or drops a column)."""
    return {name: frozenset(frame.columns) for name, frame in seed_frames().items()}


def load_tool_specs() -> tuple[ToolSpec, ...]:
    """The 27 tools from `data/tool_schemas/`, in the order the reference's `get_tools` lists them."""
    specs = []
    for toolkit in TOOLKITS:
        document = json.loads((DATA_DIR / "tool_schemas" / f"{toolkit}.json").read_text(encoding="utf-8"))
        for tool in document["tools"]:
            specs.append(
                ToolSpec(
                    name=tool["name"],
                    description=tool["description"],
                    parameters=tool["parameters"],
                    strict=bool(tool.get("strict", False)),
                )
            )
    return tuple(specs)
