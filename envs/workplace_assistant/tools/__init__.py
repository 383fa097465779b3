"""The 27 tools, one module per toolkit, and `ToolBox`, which calls them the way the reference's route does.

The reference's HTTP route drops arguments that are null, calls the method with the rest
as keywords, and answers `{"output": <result>}`; an exception becomes the output text
`Error executing tool '<name>': <message>`. Its replay for the reward (`invoke`) passes
the arguments as given, nulls included, and skips calls that raise.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from gymrpc.envs.workplace_assistant.tools._base import Toolkit
from gymrpc.envs.workplace_assistant.tools.analytics import AnalyticsTool
from gymrpc.envs.workplace_assistant.tools.calendar import CalendarTool
from gymrpc.envs.workplace_assistant.tools.customer_relationship_manager import CustomerRelationshipManagerTool
from gymrpc.envs.workplace_assistant.tools.email import CompanyDirectoryTool, EmailTool
from gymrpc.envs.workplace_assistant.tools.project_management import ProjectManagementTool
from gymrpc.snapshots import TableSet

TOOLKIT_CLASSES: tuple[type[Toolkit], ...] = (
    CompanyDirectoryTool,
    EmailTool,
    CalendarTool,
    AnalyticsTool,
    ProjectManagementTool,
    CustomerRelationshipManagerTool,
)


class ToolBox:
    """Every tool of one session, bound to its tables."""

    def __init__(self, tables: TableSet) -> None:
        self.tables = tables
        self.functions: dict[str, Any] = {}
        for cls in TOOLKIT_CLASSES:
            self.functions.update(cls(tables).functions())

    def invoke(self, name: str, arguments: Mapping[str, Any]) -> Any:
        """Call a tool with exactly these keyword arguments; its exceptions propagate."""
        return self.functions[name](**arguments)

    def call(self, name: str, arguments: Mapping[str, Any]) -> tuple[str, bool]:
        """(output text, is_error) as the reference's route answers a tool call."""
        kwargs = {key: value for key, value in arguments.items() if value is not None}
        try:
            result = self.invoke(name, kwargs)
        except Exception as exc:  # the model reads the message and may correct itself
            return output_json(f"Error executing tool '{name}': {exc}"), True
        return output_json(result), False


def output_json(result: Any) -> str:
    """`{"output": result}` as compact JSON: NaN and infinities as null, non-ASCII kept, like pydantic's JSON.

    Numpy scalars are written as numbers. (The reference's pydantic response model refuses
    them, so its per-day analytics counts fail with HTTP 500; a JSON number is what was meant.)
    """
    return json.dumps({"output": _plain(result)}, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {_key(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, str | int | bool):
        return value
    return str(value)


def _key(key: Any) -> str:
    return key if isinstance(key, str) else str(_plain(key))
