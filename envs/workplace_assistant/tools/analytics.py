"""The analytics toolkit (6 tools).

Reference quirks kept: dates are compared as strings; counts are per day
(`{date: n}`); a plot is only a file path appended to `_plots_data` with
`.loc[len(frame)]`, so its index labels are state; and
`get_average_session_duration` called with neither bound converts the session's own
`session_duration_seconds` column to float for good (the reference assigns into the
table itself in that case, into a filtered copy otherwise), which later visitor lookups show.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from gymrpc.envs.workplace_assistant.tools._base import Table, Toolkit

_PLOT_VALUES = [
    "total_visits",
    "session_duration_seconds",
    "user_engaged",
    "visits_direct",
    "visits_referral",
    "visits_search_engine",
    "visits_social_media",
]
_PLOT_TYPES = ["bar", "line", "scatter", "histogram"]


class AnalyticsTool(Toolkit):
    prefix = "analytics"
    methods = (
        "get_visitor_information_by_id",
        "create_plot",
        "total_visits_count",
        "engaged_users_count",
        "traffic_source_count",
        "get_average_session_duration",
    )
    _analytics_data = Table("analytics._analytics_data")
    _plots_data = Table("analytics._plots_data")

    def get_visitor_information_by_id(self, visitor_id: Any = None) -> Any:
        if not visitor_id:
            return "Visitor ID not provided."
        data = self._analytics_data
        found = data[data["visitor_id"] == visitor_id].to_dict(orient="records")
        return found if found else "Visitor not found."

    def create_plot(
        self, time_min: Any = None, time_max: Any = None, value_to_plot: Any = None, plot_type: Any = None
    ) -> Any:
        if not time_min:
            return "Start date not provided."
        if not time_max:
            return "End date not provided."
        if value_to_plot not in _PLOT_VALUES:
            return (
                "Value to plot must be one of 'total_visits', 'session_duration_seconds', 'user_engaged', "
                "'visits_direct', 'visits_referral', 'visits_search_engine', 'visits_social_media'"
            )
        if plot_type not in _PLOT_TYPES:
            return "Plot type must be one of 'bar', 'line', 'scatter', or 'histogram'"
        file_path = f"plots/{time_min}_{time_max}_{value_to_plot}_{plot_type}.png"
        plots = self._plots_data.copy(deep=False)
        plots.loc[len(plots)] = [file_path]
        # Enlarging an empty object column gives pandas 3's string dtype; the reference's pandas 2 kept object.
        plots["file_path"] = plots["file_path"].astype(object)
        self._plots_data = plots
        return file_path

    def _window(self, time_min: Any, time_max: Any, *, slice_all: bool) -> pd.DataFrame:
        """Rows with time_min <= date <= time_max (string comparison); a new frame unless neither is given.

        `slice_all` mirrors the reference's `data[:]` (a new frame) where it would otherwise
        keep the table itself.
        """
        data = self._analytics_data
        if time_min:
            data = data[data["date_of_visit"] >= time_min]
        elif slice_all:
            data = data[:]
        if time_max:
            data = data[data["date_of_visit"] <= time_max]
        return data

    def total_visits_count(self, time_min: Any = None, time_max: Any = None) -> Any:
        return self._window(time_min, time_max, slice_all=False).groupby("date_of_visit").size().to_dict()

    def engaged_users_count(self, time_min: Any = None, time_max: Any = None) -> Any:
        data = self._window(time_min, time_max, slice_all=True).copy(deep=False)
        data["user_engaged"] = data["user_engaged"].astype(bool).astype(int)
        return data.groupby("date_of_visit").sum()["user_engaged"].to_dict()

    def traffic_source_count(self, time_min: Any = None, time_max: Any = None, traffic_source: Any = None) -> Any:
        data = self._window(time_min, time_max, slice_all=True).copy(deep=False)
        if traffic_source:
            data["visits_from_source"] = (data["traffic_source"] == traffic_source).astype(int)
            return data.groupby("date_of_visit").sum()["visits_from_source"].to_dict()
        return data.groupby("date_of_visit").size().to_dict()

    def get_average_session_duration(self, time_min: Any = None, time_max: Any = None) -> Any:
        data = self._window(time_min, time_max, slice_all=False).copy(deep=False)
        data["session_duration_seconds"] = data["session_duration_seconds"].astype(float)
        if not time_min and not time_max:
            self._analytics_data = data  # the reference converted the table itself here
        means = data[["date_of_visit", "session_duration_seconds"]].groupby("date_of_visit").mean()
        return means["session_duration_seconds"].to_dict()
