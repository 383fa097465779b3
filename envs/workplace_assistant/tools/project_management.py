"""The project management toolkit (5 tools).

Reference quirks kept: a new task id is `str(int(max) + 1).zfill(8)` ("00000300" first);
tasks are appended with `ignore_index=True`; search needs at least one filter, matches
the assignee exactly (case-insensitive, after an email format check) and every other
field as a case-insensitive regular expression, and returns every match (no pagination);
an assignee must already appear on some task; `list_name` and `board` are case-sensitive.
"""

from __future__ import annotations

import re
from typing import Any

import pandas as pd

from gymrpc.envs.workplace_assistant.tools._base import Table, Toolkit, new_row

_LISTS = ["Backlog", "In Progress", "In Review", "Completed"]
_BOARDS = ["Back end", "Front end", "Design"]
_EMAIL = re.compile(r"^[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}$")
_BAD_ASSIGNEE = "Assignee email not valid. Please choose from the list of team members."
_BAD_LIST = "List not valid. Please choose from: 'Backlog', 'In Progress', 'In Review', 'Completed'."
_BAD_BOARD = "Board not valid. Please choose from: 'Back end', 'Front end', 'Design'."


class ProjectManagementTool(Toolkit):
    prefix = "project_management"
    methods = ("get_task_information_by_id", "search_tasks", "create_task", "delete_task", "update_task")
    _project_tasks = Table("project_management._project_tasks")

    def get_task_information_by_id(self, task_id: Any = None, field: Any = None) -> Any:
        if not task_id:
            return "Task ID not provided."
        if not field:
            return "Field not provided."
        tasks = self._project_tasks
        found = tasks[tasks["task_id"] == task_id].to_dict(orient="records")
        if not found:
            return "Task not found."
        return {field: found[0][field]} if field in found[0] else "Field not found."

    def search_tasks(
        self,
        task_name: Any = None,
        assigned_to_email: Any = None,
        list_name: Any = None,
        due_date: Any = None,
        board: Any = None,
    ) -> Any:
        if not any([task_name, assigned_to_email, list_name, due_date, board]):
            return "No search parameters provided."
        if assigned_to_email and not _EMAIL.match(assigned_to_email):
            return "Invalid email format for assigned_to_email."
        tasks = self._project_tasks.copy()
        if task_name:
            tasks = tasks[tasks["task_name"].str.contains(task_name, case=False)]
        if assigned_to_email:
            tasks = tasks[tasks["assigned_to_email"].str.lower() == assigned_to_email.lower()]
        if list_name:
            tasks = tasks[tasks["list_name"].str.contains(list_name, case=False)]
        if due_date:
            tasks = tasks[tasks["due_date"].str.contains(due_date, case=False)]
        if board:
            tasks = tasks[tasks["board"].str.contains(board, case=False)]
        return tasks.to_dict(orient="records")

    def create_task(
        self,
        task_name: Any = None,
        assigned_to_email: Any = None,
        list_name: Any = None,
        due_date: Any = None,
        board: Any = None,
    ) -> Any:
        if not all([task_name, assigned_to_email, list_name, due_date, board]):
            return "Missing task details."
        assigned_to_email = assigned_to_email.lower()
        tasks = self._project_tasks
        if assigned_to_email not in tasks["assigned_to_email"].str.lower().values:
            return _BAD_ASSIGNEE
        if list_name not in _LISTS:
            return _BAD_LIST
        if board not in _BOARDS:
            return _BAD_BOARD
        task_id = str(int(tasks["task_id"].max()) + 1).zfill(8)
        row = new_row(
            {
                "task_id": task_id,
                "task_name": task_name,
                "assigned_to_email": assigned_to_email,
                "list_name": list_name,
                "due_date": due_date,
                "board": board,
            }
        )
        self._project_tasks = pd.concat([tasks, row], ignore_index=True)
        return task_id

    def delete_task(self, task_id: Any = None) -> Any:
        if not task_id:
            return "Task ID not provided."
        tasks = self._project_tasks
        if task_id not in tasks["task_id"].values:
            return "Task not found."
        self._project_tasks = tasks[tasks["task_id"] != task_id]
        return "Task deleted successfully."

    def update_task(self, task_id: Any = None, field: Any = None, new_value: Any = None) -> Any:
        if not task_id or not field or not new_value:
            return "Task ID, field, or new value not provided."
        if field == "assigned_to_email":
            new_value = new_value.lower()
        if field == "board" and new_value not in _BOARDS:
            return _BAD_BOARD
        if field == "list_name" and new_value not in _LISTS:
            return _BAD_LIST
        tasks = self._project_tasks
        if field == "assigned_to_email" and new_value not in tasks["assigned_to_email"].str.lower().values:
            return _BAD_ASSIGNEE
        if task_id not in tasks["task_id"].values:
            return "Task not found."
        if field not in tasks.columns:
            return "Field not valid."
        tasks = tasks.copy(deep=False)
        tasks.loc[tasks["task_id"] == task_id, field] = new_value
        self._project_tasks = tasks
        return "Task updated successfully."
