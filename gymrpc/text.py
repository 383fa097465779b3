"""Plain-text output shared by the commands: aligned tables and byte counts."""

from __future__ import annotations

from collections.abc import Sequence


def table(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """`rows` (the header first) as lines of left-aligned columns two spaces apart."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def size(n: int) -> str:
    """Bytes for people: `812 B`, `3.4 KiB`, `1.2 GiB`."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def count(n: int, noun: str) -> str:
    """`1 episode`, `3 episodes` (nouns that take an s)."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
