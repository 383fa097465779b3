"""The frames behind the committed golden snapshots in `tests/snapshots/golden/`.

The golden files were written once by the version-1 codec; today's code must still decode
each to exactly the frame built here. Never regenerate them for format version 1: a new
format version gets new files beside the old ones (`python -m tests.snapshots.golden_frames`
writes only files that do not exist yet).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd

GOLDEN = Path(__file__).parent / "golden"


def crm_after_add_and_delete() -> pd.DataFrame:
    """CSV gaps (NaN) beside a row added with missing fields (None), after a delete (non-range index)."""
    frame = pd.DataFrame(
        {
            "customer_id": ["00000001", "00000002", "00000003"],
            "customer_phone": ["724-857-2625", np.nan, np.nan],
            "notes": [np.nan, "2023-10-17: Had a call. ", "Ünïcödé ✓"],
        },
        dtype=object,
    )
    frame = frame[frame["customer_id"] != "00000002"]
    added = pd.DataFrame({"customer_id": ["00000004"], "customer_phone": [None], "notes": [""]}, dtype=object)
    return pd.concat([frame, added])


def mixed_object_values() -> pd.DataFrame:
    """Every kind of value an object column can hold and keep."""
    values = [
        "text",
        None,
        float("nan"),
        60,
        -0.0,
        float("inf"),
        True,
        np.int64(7),
        np.float32(1.5),
        [1, "a"],
        {"k": None},
    ]
    return pd.DataFrame(
        {"new_value": pd.Series(values, dtype=object)}, index=pd.Index([0, 1, 1, 2, 3, 5, 8, 13, 21, 34, 55])
    )


def typed_columns() -> pd.DataFrame:
    frame = pd.DataFrame(
        {
            "engaged": np.array([True, False, True]),
            "seconds": np.array([12.0, np.nan, 4.5]),
            "count": np.array([1, -2, 3], dtype="int32"),
            "when": np.array(["2023-11-30T23:59:00", "NaT", "2023-09-01T00:00:00"], dtype="datetime64[ns]"),
            "nullable": pd.array([1, None, 3], dtype="Int64"),
            "label": pd.array(["a", None, "c"], dtype=pd.StringDtype("python", na_value=np.nan)),
        },
        index=pd.RangeIndex(10, 4, -2, name="row"),
    )
    frame.columns.name = "field"
    return frame


def empty_plots() -> pd.DataFrame:
    return pd.DataFrame(columns=["file_path"], dtype=object)


FRAMES: dict[str, Callable[[], pd.DataFrame]] = {
    "crm_after_add_and_delete": crm_after_add_and_delete,
    "mixed_object_values": mixed_object_values,
    "typed_columns": typed_columns,
    "empty_plots": empty_plots,
}


SESSION_TABLES = ("crm_after_add_and_delete", "empty_plots")
SESSION_META = {"task_id": "golden", "ground_truth": [], "verify_mode": "replay"}
SESSION_PAYLOAD = "session.v1.bundle"
"""A packed session (`gymrpc.session-tables` v1) holding two of the tables above and `SESSION_META`."""


def main() -> None:
    from gymrpc.snapshots import TABLE_FORMAT_VERSION, encode_session, encode_table, pack

    GOLDEN.mkdir(exist_ok=True)
    outputs = {
        f"{name}.v{TABLE_FORMAT_VERSION}.arrow": lambda b=build: encode_table(b()) for name, build in FRAMES.items()
    }
    outputs[SESSION_PAYLOAD] = lambda: pack(encode_session({n: FRAMES[n]() for n in SESSION_TABLES}, SESSION_META))
    for file, make in outputs.items():
        path = GOLDEN / file
        if not path.exists():
            path.write_bytes(make())
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
