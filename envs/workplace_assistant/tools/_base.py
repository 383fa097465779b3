"""What every toolkit shares: tables as attributes backed by the session's `TableSet`.

Toolkit methods read `self._emails` and assign `self._emails = new_frame`, like the
reference's tool classes; the `Table` descriptor routes both to the `TableSet`, so every
assignment bumps the table's version and its snapshot block is re-encoded. Methods never
mutate a frame in place: they modify a shallow copy (pandas copy-on-write keeps the
original intact) and assign it back.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pandas as pd

from gymrpc.snapshots import TableSet

HARDCODED_CURRENT_TIME = pd.Timestamp("2023-11-30T23:59:00")
"""The simulated "now" of the email toolkit: sent emails carry `str()` of it, `2023-11-30 23:59:00`."""


class Table:
    """A toolkit attribute that is one named table of the session."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, toolkit: Toolkit, owner: type | None = None) -> pd.DataFrame:
        return toolkit.tables.get(self.name)

    def __set__(self, toolkit: Toolkit, frame: pd.DataFrame) -> None:
        toolkit.tables.set(self.name, frame)


class Toolkit:
    """A group of tools over some of the session's tables; tool names are `<prefix>_<method>`."""

    prefix: ClassVar[str]
    methods: ClassVar[tuple[str, ...]]

    def __init__(self, tables: TableSet) -> None:
        self.tables = tables

    def functions(self) -> dict[str, Any]:
        return {f"{self.prefix}_{method}": getattr(self, method) for method in self.methods}


def paginate(records: list[Any], page: Any, page_size: Any) -> tuple[list[Any], dict[str, Any]]:
    """The reference's pagination: out-of-range pages are clamped, never an error.

    The arithmetic is the reference's, so odd arguments fail the same way (a string page
    size is a TypeError, a zero one a ZeroDivisionError) and the caller reports it.
    """
    total = len(records)
    total_pages = (total + page_size - 1) // page_size
    page = max(1, min(page, total_pages)) if total_pages > 0 else 1
    start = (page - 1) * page_size
    end = min(start + page_size, total)
    return records[start:end], {"page": page, "page_size": page_size, "total_pages": total_pages, "total": total}


def pagination(info: dict[str, Any], total_key: str) -> dict[str, Any]:
    """The reply's `pagination` object, with the total under the toolkit's own key."""
    return {
        total_key: info["total"],
        "page": info["page"],
        "page_size": info["page_size"],
        "total_pages": info["total_pages"],
    }


def new_row(values: dict[str, Any]) -> pd.DataFrame:
    """A one-row object frame: pandas 3 would infer its new string dtype, the reference's pandas 2 object."""
    return pd.DataFrame({column: [value] for column, value in values.items()}, dtype=object)
