"""The 27 tools behave as the reference's, including the quirks that change results."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gymrpc.envkit import InvalidTask, TaskSpec, ToolError
from gymrpc.envs.workplace_assistant import (
    WorkplaceEnvironment,
    WorkplaceSession,
    example_rollouts_path,
    example_tasks_path,
)


def _session(**fields: Any) -> WorkplaceSession:
    session, observations = WorkplaceEnvironment().seed(TaskSpec("t", [], {"ground_truth": [], **fields}))
    assert observations == ()
    return session


def _out(session: WorkplaceSession, tool: str, **arguments: Any) -> Any:
    return json.loads(session.call_tool(tool, arguments).output)["output"]


def test_tools_are_the_27_of_the_schemas_in_the_tasks_order() -> None:
    tools = WorkplaceEnvironment().tools()
    assert len(tools) == 27
    row = json.loads(example_tasks_path().read_text().splitlines()[0])
    expected = row["responses_create_params"]["tools"]
    assert [t.name for t in tools] == [t["name"] for t in expected]
    for spec, tool in zip(tools, expected, strict=True):
        assert (spec.description, dict(spec.parameters), spec.strict) == (
            tool["description"],
            tool["parameters"],
            False,
        )


def test_recorded_tool_outputs_are_reproduced_byte_for_byte() -> None:
    for line in example_rollouts_path().read_text().splitlines():
        session, outputs = _session(), {}
        for item in json.loads(line)["response"]["output"]:
            if item["type"] == "function_call":
                outputs[item["call_id"]] = session.call_tool(item["name"], json.loads(item["arguments"])).output
            elif item["type"] == "function_call_output":
                assert outputs[item["call_id"]] == item["output"]


def test_new_ids_follow_the_reference() -> None:
    s = _session()
    event = {
        "event_name": "Sync",
        "participant_email": "A.B@atlas.com",
        "event_start": "2023-12-01 10:00:00",
        "duration": "30",
    }
    assert _out(s, "calendar_create_event", **event) == "00000300"
    assert _out(s, "calendar_create_event", **event) == "00000301"
    task = {
        "task_name": "T",
        "assigned_to_email": "leila.azizi@atlas.com",
        "list_name": "Backlog",
        "due_date": "2023-12-01",
        "board": "Design",
    }
    assert _out(s, "project_management_create_task", **task) == "00000300"
    assert (
        _out(
            s,
            "customer_relationship_manager_add_customer",
            customer_name="N",
            assigned_to_email="x@y.com",
            status="Lead",
        )
        == "00000200"
    )
    mail = {"recipient": "X@Y.com", "subject": "s", "body": "b"}
    assert _out(s, "email_send_email", **mail) == "Email sent successfully."
    assert _out(s, "email_send_email", **mail) == "Email sent successfully."
    emails = s.tables.get("email._emails")
    assert list(emails["email_id"].iloc[-2:]) == ["500", "501"]  # unpadded, and "500" > "00000499" as strings
    assert list(emails["sent_datetime"].iloc[-2:]) == ["2023-11-30 23:59:00"] * 2
    assert list(emails["sender/recipient"].iloc[-2:]) == ["x@y.com"] * 2


def test_created_events_repeat_index_labels_and_added_customers_hold_none() -> None:
    s = _session()
    _out(
        s,
        "calendar_create_event",
        event_name="E",
        participant_email="a@b.c",
        event_start="2023-12-01 10:00:00",
        duration="30",
    )
    assert list(s.tables.get("calendar._calendar_events").index[-2:]) == [299, 0]
    _out(s, "customer_relationship_manager_add_customer", customer_name="N", assigned_to_email="x@y.com", status="Lead")
    crm = s.tables.get("customer_relationship_manager._crm_data")
    assert crm["customer_phone"].iloc[-1] is None
    assert crm["notes"].iloc[-1] == ""
    assert isinstance(crm["customer_phone"].iloc[0], float)  # the CSV's empty cell: NaN
    assert {dtype.kind for dtype in crm.dtypes} == {"O"}


def test_pagination_clamps_the_page_and_counts_pages() -> None:
    s = _session()
    result = _out(s, "email_search_emails", query="kofi", page=99, page_size=10)
    assert result["pagination"] == {"total_emails": 26, "page": 3, "page_size": 10, "total_pages": 3}
    assert len(result["emails"]) == 6
    assert _out(s, "email_search_emails", query="no such words here") == "No emails found."
    events = _out(s, "calendar_search_events", query="sync", page=0)
    assert events["pagination"]["page"] == 1
    assert len(events["events"]) == 5


@pytest.mark.parametrize(
    ("name", "arguments", "output"),
    [
        ("email_send_email", {"recipient": "nobody", "subject": "s", "body": "b"}, "Invalid recipient email address."),
        ("email_delete_email", {"email_id": "nope"}, "Email not found."),
        ("calendar_delete_event", {"event_id": "123"}, "Invalid event ID format. Expected 8-digit ID."),
        (
            "calendar_update_event",
            {"event_id": "00000013", "field": "duration", "new_value": "-5"},
            "Duration must be a positive number of minutes.",
        ),
        (
            "customer_relationship_manager_search_customers",
            {},
            "No search parameters provided. Please provide at least one parameter.",
        ),
        (
            "customer_relationship_manager_update_customer",
            {"customer_id": "00000014", "field": "status", "new_value": "won"},
            "Status not valid. Please choose from: 'Qualified', 'Won', 'Lost', 'Lead', 'Proposal'",
        ),
        (
            "project_management_create_task",
            {
                "task_name": "t",
                "assigned_to_email": "x@y.com",
                "list_name": "Backlog",
                "due_date": "d",
                "board": "Design",
            },
            "Assignee email not valid. Please choose from the list of team members.",
        ),
        (
            "analytics_create_plot",
            {"time_min": "a", "time_max": "b", "value_to_plot": "total_visits", "plot_type": "pie"},
            "Plot type must be one of 'bar', 'line', 'scatter', or 'histogram'",
        ),
        ("company_directory_find_email_address", {}, "Name not provided."),
        (
            "email_search_emails",
            {"page_size": "5"},
            "Error searching emails: unsupported operand type(s) for +: 'int' and 'str'",
        ),
    ],
)
def test_refusals_are_the_reference_texts(name: str, arguments: dict[str, Any], output: str) -> None:
    result = _session().call_tool(name, arguments)
    assert json.loads(result.output)["output"] == output
    assert not result.is_error


def test_exceptions_become_the_reference_error_text() -> None:
    s = _session()
    result = s.call_tool("company_directory_find_email_address", {"name": "("})
    assert result.is_error
    assert json.loads(result.output)["output"].startswith(
        "Error executing tool 'company_directory_find_email_address': missing ), unterminated subpattern"
    )
    result = s.call_tool("email_send_email", {"recipient": "a@b.c", "subject": "s", "body": "b", "cc": "x"})
    assert json.loads(result.output)["output"] == (
        "Error executing tool 'email_send_email': EmailTool.send_email() got an unexpected keyword argument 'cc'"
    )
    # nulls are dropped as the reference's route drops them: the default applies
    assert _out(s, "company_directory_find_email_address", name=None) == "Name not provided."
    with pytest.raises(ToolError, match="unknown tool"):
        s.call_tool("no_such_tool", {})


def test_reads_that_change_state_as_in_the_reference() -> None:
    s = _session()
    visitor = _out(s, "analytics_get_visitor_information_by_id", visitor_id="0860")
    assert visitor[0]["session_duration_seconds"] == "4"
    _out(s, "analytics_get_average_session_duration", time_max="2023-11-30")  # a bounded call copies: no change
    assert s.tables.version("analytics._analytics_data") == 0
    averages = _out(s, "analytics_get_average_session_duration")
    assert len(averages) == 91
    assert isinstance(averages["2023-09-01"], float)
    visitor = _out(s, "analytics_get_visitor_information_by_id", visitor_id="0860")
    assert visitor[0]["session_duration_seconds"] == 4.0  # the unbounded call converted the table itself
    counts = _out(s, "analytics_traffic_source_count", time_min="2023-11-29", traffic_source="direct")
    assert list(counts) == ["2023-11-29", "2023-11-30"]
    assert all(isinstance(v, int) for v in counts.values())
    assert (
        _out(s, "analytics_create_plot", time_min="a", time_max="b", value_to_plot="user_engaged", plot_type="bar")
        == "plots/a_b_user_engaged_bar.png"
    )
    plots = s.tables.get("analytics._plots_data")
    assert list(plots.index) == [0]
    assert plots.dtypes["file_path"].kind == "O"


def test_tasks_must_carry_a_ground_truth_and_a_known_mode() -> None:
    env = WorkplaceEnvironment()
    for fields in (
        {},
        {"ground_truth": "x"},
        {"ground_truth": [{"name": "a"}]},
        {"ground_truth": [{"name": "a", "arguments": "[]"}]},
    ):
        with pytest.raises(InvalidTask):
            env.seed(TaskSpec("t", [], fields))
    with pytest.raises(InvalidTask, match="verify_mode"):
        env.seed(TaskSpec("t", [], {"ground_truth": [], "verify_mode": "strictest"}))
