"""The calendar toolkit (5 tools).

Reference quirks kept: event ids must be 8 digits; a new id is `str(int(max) + 1).zfill(8)`
(the first is "00000300"); a created event is appended with `pd.concat` *without*
`ignore_index`, so its index label repeats an existing one (the index is state); search
matches the query as a case-insensitive regular expression in the name or the participant,
filters on the start time only, newest first, 5 per page, page clamped into range.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from gymrpc.envs.workplace_assistant.tools._base import Table, Toolkit, new_row, paginate, pagination

_FIELDS = ["event_id", "event_name", "participant_email", "event_start", "duration"]
_UPDATABLE = ["event_name", "participant_email", "event_start", "duration"]


def _is_event_id(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 8 and value.isdigit()


def _duration_problem(value: Any) -> str | None:
    try:
        if int(value) <= 0:
            return "Duration must be a positive number of minutes."
    except ValueError:
        return "Invalid duration format. Expected a number of minutes."
    return None


class CalendarTool(Toolkit):
    prefix = "calendar"
    methods = ("get_event_information_by_id", "search_events", "create_event", "delete_event", "update_event")
    _calendar_events = Table("calendar._calendar_events")

    def get_event_information_by_id(self, event_id: Any = None, field: Any = None) -> Any:
        if not event_id:
            return "Event ID not provided."
        if not field:
            return "Field not provided."
        if not _is_event_id(event_id):
            return "Invalid event ID format. Expected 8-digit ID."
        if field not in _FIELDS:
            return f"Invalid field. Available fields are: {', '.join(_FIELDS)}"
        events = self._calendar_events
        found = events[events["event_id"] == event_id].to_dict(orient="records")
        if not found:
            return "Event not found."
        return {field: found[0][field]} if field in found[0] else "Field not found."

    def search_events(
        self, query: Any = "", time_min: Any = None, time_max: Any = None, page: Any = 1, page_size: Any = 5
    ) -> Any:
        if time_min:
            try:
                time_min = pd.Timestamp(time_min)
            except ValueError:
                return "Invalid time_min format. Expected YYYY-MM-DD HH:MM:SS."
        if time_max:
            try:
                time_max = pd.Timestamp(time_max)
            except ValueError:
                return "Invalid time_max format. Expected YYYY-MM-DD HH:MM:SS."
        events = self._calendar_events
        in_name = events["event_name"].str.contains(query, case=False, na=False)
        in_participant = events["participant_email"].str.contains(query, case=False, na=False)
        found = events[in_name | in_participant].to_dict(orient="records")
        if time_min:
            found = [e for e in found if pd.Timestamp(e["event_start"]) >= time_min]
        if time_max:
            found = [e for e in found if pd.Timestamp(e["event_start"]) <= time_max]
        if not found:
            return "No events found."
        found.sort(key=lambda e: pd.Timestamp(e["event_start"]), reverse=True)
        shown, info = paginate(found, page, page_size)
        return {"events": shown, "pagination": pagination(info, "total_events")}

    def create_event(
        self, event_name: Any = None, participant_email: Any = None, event_start: Any = None, duration: Any = None
    ) -> Any:
        if not event_name:
            return "Event name not provided."
        if not participant_email:
            return "Participant email not provided."
        if not event_start:
            return "Event start not provided."
        if not duration:
            return "Event duration not provided."
        try:
            pd.Timestamp(event_start)
        except ValueError:
            return "Invalid event_start format. Expected YYYY-MM-DD HH:MM:SS."
        problem = _duration_problem(duration)
        if problem:
            return problem
        participant_email = participant_email.lower()
        events = self._calendar_events
        event_id = str(int(events["event_id"].max()) + 1).zfill(8)
        row = new_row(
            {
                "event_id": event_id,
                "event_name": event_name,
                "participant_email": participant_email,
                "event_start": event_start,
                "duration": duration,
            }
        )
        self._calendar_events = pd.concat([events, row])  # no ignore_index: the new row's label is 0 again
        return event_id

    def delete_event(self, event_id: Any = None) -> Any:
        if not event_id:
            return "Event ID not provided."
        if not _is_event_id(event_id):
            return "Invalid event ID format. Expected 8-digit ID."
        events = self._calendar_events
        if event_id not in events["event_id"].values:
            return "Event not found."
        self._calendar_events = events[events["event_id"] != event_id]
        return "Event deleted successfully."

    def update_event(self, event_id: Any = None, field: Any = None, new_value: Any = None) -> Any:
        if not event_id or not field or not new_value:
            return "Event ID, field, or new value not provided."
        if not _is_event_id(event_id):
            return "Invalid event ID format. Expected 8-digit ID."
        if field not in _UPDATABLE:
            return f"Invalid field. Available fields are: {', '.join(_UPDATABLE)}"
        if field == "event_start":
            try:
                pd.Timestamp(new_value)
            except ValueError:
                return "Invalid event_start format. Expected YYYY-MM-DD HH:MM:SS."
        elif field == "duration":
            problem = _duration_problem(new_value)
            if problem:
                return problem
        events = self._calendar_events
        if event_id not in events["event_id"].values:
            return "Event not found."
        if field == "participant_email":
            new_value = new_value.lower()
        events = events.copy(deep=False)
        events.loc[events["event_id"] == event_id, field] = new_value
        self._calendar_events = events
        return "Event updated successfully."
